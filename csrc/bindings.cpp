// Python bindings of the C++ radix tree and page allocator: radix_runtime.scheduler._radix_tree.
//
// Token and page arrays cross the boundary as int32 numpy buffers: a C-contiguous int32 array is
// read in place, anything else (a list, int64 ids) is converted once, like
// np.asarray(x, dtype=np.int32). Node handles are the C++ nodes themselves (shared_ptr holders):
// pybind11 returns the same Python object for a node while one is alive, so `m.node is r.node`
// and the scheduler's id()-keyed walks work as with Python nodes.
// The wrapper with the RadixCache interface is radix_runtime/scheduler/radix_cache_cpp.py.
//
// NOTE: a match costs about a microsecond of fixed overhead, so the calls below avoid
// pybind11's generic array conversion and namedtuple construction through Python code.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>

#include "page_allocator.h"
#include "radix_tree.h"

namespace py = pybind11;
using radix::Node;
using radix::NodePtr;
using radix::PageAllocator;
using radix::Tree;

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

namespace {

// ---------------------------------------------------------------------------- conversions

// int32 ids read in place from a C-contiguous native int32 array, else from a converted copy.
struct Int32View {
    const int32_t* data = nullptr;
    int64_t size = 0;
    py::object keep;  // the converted copy, if one was made

    explicit Int32View(py::handle h) {
        auto& api = py::detail::npy_api::get();
        if (api.PyArray_Check_(h.ptr())) {
            auto* a = py::detail::array_proxy(h.ptr());
            auto* d = py::detail::array_descriptor_proxy(a->descr);
            const int wanted = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ |
                               py::detail::npy_api::NPY_ARRAY_ALIGNED_;
            if (d->type_num == py::detail::npy_api::NPY_INT32_ && d->byteorder != '>' &&
                (a->flags & wanted) == wanted) {
                data = reinterpret_cast<const int32_t*>(a->data);
                size = 1;
                for (int i = 0; i < a->nd; ++i) size *= a->dimensions[i];
                return;
            }
        }
        Int32Array copy = Int32Array::ensure(h);
        if (!copy) throw py::type_error("expected an array of int32 ids");
        data = copy.data();
        size = copy.size();
        keep = std::move(copy);
    }
};

// A new 1-D int32 array of `n` elements; `data` gets its buffer.
py::array new_int32_array(int64_t n, int32_t** data) {
    auto& api = py::detail::npy_api::get();
    Py_intptr_t dims[1] = {static_cast<Py_intptr_t>(n)};
    PyObject* descr = api.PyArray_DescrFromType_(py::detail::npy_api::NPY_INT32_);
    PyObject* arr = api.PyArray_NewFromDescr_(api.PyArray_Type_, descr, 1, dims, nullptr,
                                              nullptr, 0, nullptr);
    if (!arr) throw py::error_already_set();
    *data = reinterpret_cast<int32_t*>(py::detail::array_proxy(arr)->data);
    return py::reinterpret_steal<py::array>(arr);
}

// A read-only copy of `n` ids (the tree's state is never aliased).
py::array to_array(const int32_t* src, size_t n) {
    int32_t* dst;
    py::array out = new_int32_array(static_cast<int64_t>(n), &dst);
    if (n) std::memcpy(dst, src, sizeof(int32_t) * n);
    py::detail::array_proxy(out.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return out;
}

py::array to_array(const std::vector<int32_t>& v) { return to_array(v.data(), v.size()); }

py::object handle(Node* node) {
    return node ? py::cast(node->shared_from_this()) : py::none();
}

Node* checked(Node* node) {
    if (!node) throw py::type_error("expected a TreeNode, got None");
    return node;
}

// namedtuple_type(*items), through tuple.__new__ (what the namedtuple's Python __new__ calls).
py::object make_namedtuple(const py::object& type, py::tuple items) {
    py::tuple args = py::make_tuple(std::move(items));
    PyObject* out =
        PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(type.ptr()), args.ptr(), nullptr);
    if (!out) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
}

// ------------------------------------------------------------------------------- the tree

// The tree plus what its Python face needs: the result types and reusable scratch vectors.
struct PyTree {
    PyTree(int32_t page_size, py::object match_type, py::object insert_type)
        : tree(page_size), match_type(std::move(match_type)), insert_type(std::move(insert_type)) {}
    Tree tree;
    py::object match_type;   // radix_cache.MatchResult
    py::object insert_type;  // radix_cache.InsertResult
    std::vector<Node*> path;
    std::vector<int32_t> released;
};

py::object match_prefix(PyTree& self, py::handle tokens) {
    Int32View view(tokens);
    int64_t length = 0;
    Node* node = self.tree.match_prefix(view.data, view.size, self.path, length);
    int32_t* out;
    py::array pages = new_int32_array(length / self.tree.page_size(), &out);
    for (const Node* n : self.path) {
        std::memcpy(out, n->pages.data(), sizeof(int32_t) * n->pages.size());
        out += n->pages.size();
    }
    py::detail::array_proxy(pages.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return make_namedtuple(self.match_type,
                           py::make_tuple(std::move(pages), length, handle(node)));
}

py::object insert(PyTree& self, py::handle tokens, py::handle pages) {
    Int32View t(tokens), p(pages);
    int64_t prefix_len = 0;
    Node* node = self.tree.insert(t.data, t.size, p.data, p.size, prefix_len);
    return make_namedtuple(self.insert_type, py::make_tuple(prefix_len, handle(node)));
}

py::tuple evict(PyTree& self, int64_t num_pages) {
    self.released.clear();
    int64_t freed = self.tree.evict(num_pages, self.released);
    return py::make_tuple(freed, to_array(self.released));
}

// Evicts straight into a C++ allocator: no array crosses into Python.
int64_t evict_into(PyTree& self, PageAllocator& allocator, int64_t num_pages) {
    self.released.clear();
    int64_t freed = self.tree.evict(num_pages, self.released);
    allocator.free(self.released.data(), static_cast<int64_t>(self.released.size()));
    return freed;
}

py::array reset(PyTree& self) {
    self.released.clear();
    self.tree.reset(self.released);
    return to_array(self.released);
}

void reset_into(PyTree& self, PageAllocator& allocator) {
    self.released.clear();
    self.tree.reset(self.released);
    allocator.free(self.released.data(), static_cast<int64_t>(self.released.size()));
}

py::array all_pages(const PyTree& self) {
    std::vector<int32_t> pages;
    for (const Node* node : self.tree.nodes())
        pages.insert(pages.end(), node->pages.begin(), node->pages.end());
    return to_array(pages);
}

// Children as the Python tree holds them: {bytes of the first token / page: node}, in insertion
// order.
py::dict children(const Node& node) {
    py::dict out;
    for (Node* child : node.ordered_children()) {
        py::bytes first(reinterpret_cast<const char*>(child->key.data()),
                        sizeof(int32_t) * std::min<size_t>(node.page_size, child->key.size()));
        out[first] = handle(child);
    }
    return out;
}

// ---------------------------------------------------------------------- the page allocator

py::object alloc_pages(PageAllocator& a, int64_t n) {
    if (n >= 0 && n > a.free_pages()) return py::none();
    int32_t* out;
    py::array pages = new_int32_array(n < 0 ? 0 : n, &out);
    a.alloc(n, out);  // throws for n < 0
    return std::move(pages);
}

// Accepts what np.asarray accepts, like allocator.PageAllocator.free.
void free_pages(PageAllocator& a, py::handle pages) {
    py::array arr = py::array::ensure(pages);
    if (!arr) throw py::type_error("pages must be an array of page ids");
    if (arr.size() == 0) return;
    const char kind = arr.dtype().kind();
    if (arr.ndim() != 1 || (kind != 'i' && kind != 'u'))
        throw py::value_error(py::str("pages must be a 1-D integer array, got {} {}")
                                  .format(arr.dtype(), arr.attr("shape")));
    if (kind == 'i' && arr.itemsize() == 4) {
        Int32View ids(arr);
        a.free(ids.data, ids.size);
    } else {
        auto ids = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
        a.free(ids.data(), ids.size());
    }
}

}  // namespace

PYBIND11_MODULE(_radix_tree, m) {
    m.doc() = "The radix tree of KV-cache pages and the page allocator in C++ (csrc/)";
    py::register_exception<radix::IntegrityError>(m, "IntegrityError", PyExc_AssertionError);

    py::class_<Node, NodePtr>(m, "TreeNode")
        .def_property_readonly("id", [](const Node& n) { return n.id; })
        .def_property_readonly("parent", [](const Node& n) { return handle(n.parent); })
        .def_property_readonly("last_access", [](const Node& n) { return n.last_access; })
        .def_property_readonly("key", [](const Node& n) { return to_array(n.key); })
        .def_property_readonly("children", &children)
        // Writable, like the Python node's fields, so that tests can corrupt them.
        .def_property(
            "lock_ref", [](const Node& n) { return n.lock_ref; },
            [](Node& n, int64_t v) { n.lock_ref = v; })
        .def_property(
            "pages", [](const Node& n) { return to_array(n.pages); },
            [](Node& n, py::handle v) {
                Int32View ids(v);
                n.pages.assign(ids.data, ids.data + ids.size);
            })
        .def("__repr__", &Node::repr);

    py::class_<PyTree>(m, "RadixTree")
        .def(py::init<int32_t, py::object, py::object>(), py::arg("page_size"),
             py::arg("match_type"), py::arg("insert_type"))
        .def_property_readonly("page_size", [](const PyTree& t) { return t.tree.page_size(); })
        .def_property_readonly("root", [](const PyTree& t) { return t.tree.root(); })
        .def_property_readonly("evictable_pages",
                               [](const PyTree& t) { return t.tree.evictable_pages(); })
        .def_property_readonly("protected_pages",
                               [](const PyTree& t) { return t.tree.protected_pages(); })
        .def_property_readonly("num_nodes", [](const PyTree& t) { return t.tree.num_nodes(); })
        .def_property_readonly("heap_size", [](const PyTree& t) { return t.tree.heap_size(); })
        .def("match_prefix", &match_prefix, py::arg("tokens"),
             "-> match_type(pages, length, node), as RadixCache.match_prefix")
        .def("insert", &insert, py::arg("tokens"), py::arg("pages"),
             "-> insert_type(prefix_len, node), as RadixCache.insert")
        .def("lock", [](PyTree& t, Node* n) { t.tree.lock(checked(n)); })
        .def("unlock", [](PyTree& t, Node* n) { t.tree.unlock(checked(n)); })
        .def("evict", &evict, py::arg("num_pages"),
             "-> (freed, pages): the caller returns the pages to its allocator")
        .def("evict_into", &evict_into, py::arg("allocator"), py::arg("num_pages"),
             "-> freed; the pages go straight back to a C++ PageAllocator")
        .def("reset", &reset, "drop every node -> the pages to free")
        .def("reset_into", &reset_into, py::arg("allocator"))
        .def("check_integrity",
             [](const PyTree& t, bool expect_unlocked) { t.tree.check_integrity(expect_unlocked); },
             py::arg("expect_unlocked") = false)
        .def("all_pages", &all_pages, "every cached page id, in the Python tree's node order")
        .def("_debug_clear_heap", [](PyTree& t) { t.tree.debug_clear_heap(); })
        .def("_debug_add_evictable", [](PyTree& t, int64_t n) { t.tree.debug_add_evictable(n); });

    py::class_<PageAllocator>(m, "PageAllocator")
        .def(py::init<int64_t>(), py::arg("num_pages"))
        .def_property_readonly("num_pages", &PageAllocator::num_pages)
        .def_property_readonly("total_pages", &PageAllocator::total_pages)
        .def_property_readonly("free_pages", &PageAllocator::free_pages)
        .def("alloc", &alloc_pages, py::arg("n"),
             "`n` page ids (int32), or None when fewer than `n` are free")
        .def("free", &free_pages, py::arg("pages"))
        .def("free_page_ids",
             [](const PageAllocator& a) {
                 int32_t* out;
                 py::array ids = new_int32_array(a.free_pages(), &out);
                 std::memcpy(out, a.free_list(), sizeof(int32_t) * a.free_pages());
                 return ids;
             })
        .def("check_integrity", &PageAllocator::check_integrity)
        .def("__repr__", [](const PageAllocator& a) {
            return "PageAllocator(free=" + std::to_string(a.free_pages()) + "/" +
                   std::to_string(a.total_pages()) + ")";
        });
}
