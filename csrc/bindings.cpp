// Python bindings of the C++ radix tree and page allocator: radix_runtime.scheduler._radix_tree.
//
// Token and page arrays cross the boundary as int32 numpy buffers: a C-contiguous int32 array is
// read in place, anything else (a list, int64 ids) is converted once, like
// np.asarray(x, dtype=np.int32). The wrapper with the RadixCache interface is
// radix_runtime/scheduler/radix_cache_cpp.py.
//
// NOTE: the tree's hot calls (match_prefix, insert, lock, unlock, evict) cost about as much as
// the C++ work behind them when they go through pybind11's generic dispatcher (overload
// resolution, argument casters, a registered-instance lookup per returned node). So the tree
// and its nodes are plain CPython types with METH_FASTCALL methods, written out below:
//   - RadixTree: the tree; match_prefix / insert build their MatchResult / InsertResult
//     namedtuples directly (tp_alloc + fill, what the namedtuple's tuple.__new__ does).
//   - TreeNode: a handle that owns a shared_ptr to its node. The node remembers its handle
//     (Node::py_handle, cleared when the handle dies), so a node always has ONE Python object
//     while any exists: `m.node is r.node`, and the scheduler's id()-keyed walks work.
// The page allocator, whose calls are not per-token work, stays a pybind11 class.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <new>
#include <string>

#include "page_allocator.h"
#include "radix_tree.h"

namespace py = pybind11;
using radix::Node;
using radix::NodePtr;
using radix::PageAllocator;
using radix::Tree;

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

namespace {

PyObject* integrity_error = nullptr;  // _radix_tree.IntegrityError (an AssertionError)

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

void make_read_only(const py::array& a) {
    py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
}

// A read-only copy of `n` ids (the tree's state is never aliased).
py::array to_array(const int32_t* src, size_t n) {
    int32_t* dst;
    py::array out = new_int32_array(static_cast<int64_t>(n), &dst);
    if (n) std::memcpy(dst, src, sizeof(int32_t) * n);
    make_read_only(out);
    return out;
}

py::array to_array(const std::vector<int32_t>& v) { return to_array(v.data(), v.size()); }

// Runs `f` (returning a new reference or nullptr) with C++ and pybind11 exceptions turned
// into Python ones, as pybind11's dispatcher would.
template <typename F>
PyObject* guarded(F&& f) noexcept {
    try {
        return f();
    } catch (py::error_already_set& e) {
        e.restore();
    } catch (py::builtin_exception& e) {
        e.set_error();
    } catch (const radix::IntegrityError& e) {
        PyErr_SetString(integrity_error, e.what());
    } catch (const std::invalid_argument& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return nullptr;
}

bool check_nargs(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return true;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd argument%s (%zd given)", name, want,
                 want == 1 ? "" : "s", nargs);
    return false;
}

// A call with `want` arguments and an optional namespace after them (None or a str): true with
// `ns` filled (`*ns_ptr` nullptr for the public namespace), or false with a TypeError set.
// (METH_FASTCALL | METH_KEYWORDS: the namespace may also be passed as namespace=...)
bool namespace_arg(const char* name, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                   Py_ssize_t want, std::string& ns, const std::string** ns_ptr) {
    *ns_ptr = nullptr;
    PyObject* value = nargs > want ? args[want] : Py_None;
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw > 1 || (nkw == 1 && (nargs != want ||
                                 PyUnicode_CompareWithASCIIString(
                                     PyTuple_GET_ITEM(kwnames, 0), "namespace") != 0))) {
        PyErr_Format(PyExc_TypeError, "%s() takes only 'namespace' as a keyword", name);
        return false;
    }
    if (nkw == 1) value = args[nargs];
    if (nargs != want && nargs != want + 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd arguments (%zd given)", name, want,
                     want + 1, nargs);
        return false;
    }
    if (value == Py_None) return true;
    if (!PyUnicode_Check(value)) {
        PyErr_Format(PyExc_TypeError, "a namespace is a str or None, got %s",
                     Py_TYPE(value)->tp_name);
        return false;
    }
    Py_ssize_t size;
    const char* utf8 = PyUnicode_AsUTF8AndSize(value, &size);
    if (!utf8) return false;
    ns.assign(utf8, static_cast<size_t>(size));
    *ns_ptr = &ns;
    return true;
}

// ------------------------------------------------------------------------- TreeNode handles

struct PyNode {
    PyObject_HEAD
    NodePtr node;
};

PyTypeObject NodeType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The node's one Python handle (a new reference), created on first use; None for nullptr.
PyObject* handle(Node* node) {
    if (!node) Py_RETURN_NONE;
    if (node->py_handle) {
        PyObject* h = static_cast<PyObject*>(node->py_handle);
        Py_INCREF(h);
        return h;
    }
    PyObject* h = NodeType.tp_alloc(&NodeType, 0);
    if (!h) return nullptr;
    new (&reinterpret_cast<PyNode*>(h)->node) NodePtr(node->shared_from_this());
    node->py_handle = h;
    return h;
}

void node_dealloc(PyObject* self) {
    auto* h = reinterpret_cast<PyNode*>(self);
    if (h->node && h->node->py_handle == self) h->node->py_handle = nullptr;
    h->node.~NodePtr();
    Py_TYPE(self)->tp_free(self);
}

// The node behind a TreeNode argument, or nullptr with a TypeError set.
Node* node_arg(PyObject* o) {
    if (Py_TYPE(o) == &NodeType) return reinterpret_cast<PyNode*>(o)->node.get();
    PyErr_Format(PyExc_TypeError, "expected a TreeNode, got %s",
                 o == Py_None ? "None" : Py_TYPE(o)->tp_name);
    return nullptr;
}

Node& self_node(PyObject* self) { return *reinterpret_cast<PyNode*>(self)->node; }

PyObject* node_repr(PyObject* self) {
    return guarded([&] { return PyUnicode_FromString(self_node(self).repr().c_str()); });
}

PyObject* node_get_id(PyObject* self, void*) { return PyLong_FromLongLong(self_node(self).id); }
PyObject* node_get_parent(PyObject* self, void*) { return handle(self_node(self).parent); }
PyObject* node_get_last_access(PyObject* self, void*) {
    return PyLong_FromLongLong(self_node(self).last_access);
}
PyObject* node_get_namespace(PyObject* self, void*) {
    const Node& n = self_node(self);
    if (!n.ns) Py_RETURN_NONE;
    return PyUnicode_FromStringAndSize(n.ns->data(), static_cast<Py_ssize_t>(n.ns->size()));
}
PyObject* node_get_lock_ref(PyObject* self, void*) {
    return PyLong_FromLongLong(self_node(self).lock_ref);
}
PyObject* node_get_key(PyObject* self, void*) {
    return guarded([&] {
        const Node& n = self_node(self);
        return to_array(n.key(), static_cast<size_t>(n.key_len())).release().ptr();
    });
}
PyObject* node_get_host_pages(PyObject* self, void*) {
    return guarded([&]() -> PyObject* {
        const Node& n = self_node(self);
        if (!n.on_host) Py_RETURN_NONE;
        return to_array(n.host_pages).release().ptr();
    });
}
PyObject* node_get_dev_children(PyObject* self, void*) {
    return PyLong_FromLongLong(self_node(self).dev_children);
}
PyObject* node_get_load_pending(PyObject* self, void*) {
    return PyBool_FromLong(self_node(self).load_pending);
}
PyObject* node_get_in_copy_heap(PyObject* self, void*) {
    return PyBool_FromLong(self_node(self).in_copy_heap);
}
PyObject* node_get_on_device(PyObject* self, void*) {
    return PyBool_FromLong(self_node(self).on_device());
}
PyObject* node_get_pages(PyObject* self, void*) {
    return guarded([&] {
        const Node& n = self_node(self);
        return to_array(n.pages(), static_cast<size_t>(n.num_pages())).release().ptr();
    });
}

// Children as the Python tree holds them: {bytes of the first token / page: node}, in
// insertion order; the root's namespace nodes under their names (str).
PyObject* node_get_children(PyObject* self, void*) {
    return guarded([&] {
        const Node& node = self_node(self);
        py::dict out;
        for (Node* child : node.ordered_children()) {
            if (child->ns) {
                out[py::str(*child->ns)] = py::reinterpret_steal<py::object>(handle(child));
                continue;
            }
            const size_t n = std::min<size_t>(node.page_size, child->key_len());
            py::bytes first(reinterpret_cast<const char*>(child->key()), sizeof(int32_t) * n);
            out[first] = py::reinterpret_steal<py::object>(handle(child));
        }
        return out.release().ptr();
    });
}

// Writable, like the Python node's fields, so that tests can corrupt them.
int node_set_lock_ref(PyObject* self, PyObject* value, void*) {
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete lock_ref");
        return -1;
    }
    const long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    self_node(self).lock_ref = v;
    return 0;
}

int node_set_pages(PyObject* self, PyObject* value, void*) {
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete pages");
        return -1;
    }
    PyObject* ok = guarded([&] {
        Int32View ids(value);
        self_node(self).set_pages(ids.data, ids.size);
        Py_RETURN_NONE;
    });
    if (!ok) return -1;
    Py_DECREF(ok);
    return 0;
}

PyGetSetDef node_getset[] = {
    {"id", node_get_id, nullptr, nullptr, nullptr},
    {"parent", node_get_parent, nullptr, "None for the root and for evicted nodes", nullptr},
    {"last_access", node_get_last_access, nullptr, nullptr, nullptr},
    {"key", node_get_key, nullptr, "the edge's tokens (a read-only copy)", nullptr},
    {"pages", node_get_pages, node_set_pages, "the edge's page ids (a read-only copy)", nullptr},
    {"children", node_get_children, nullptr, "{first token / page bytes: node} (a copy)",
     nullptr},
    {"lock_ref", node_get_lock_ref, node_set_lock_ref, nullptr, nullptr},
    {"namespace", node_get_namespace, nullptr, "a namespace node's name, else None", nullptr},
    {"host_pages", node_get_host_pages, nullptr,
     "the host tier's page ids (a read-only copy), None when not on the host", nullptr},
    {"dev_children", node_get_dev_children, nullptr, "children on the device", nullptr},
    {"on_device", node_get_on_device, nullptr, "whether the KV is on the device", nullptr},
    {"load_pending", node_get_load_pending, nullptr, "a load into it is queued", nullptr},
    {"in_copy_heap", node_get_in_copy_heap, nullptr, "filed as a droppable host copy", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// ------------------------------------------------------------------------------- the tree

// The host tier's pool as the tree sees it: the C++ allocator, or any object with the Python
// allocator's interface (free_pages, alloc(n) -> ids or None, free(ids)).
struct CppPool final : radix::PagePool {
    PageAllocator& a;
    explicit CppPool(PageAllocator& alloc) : a(alloc) {}
    int64_t free_pages() override { return a.free_pages(); }
    bool alloc(int64_t n, std::vector<int32_t>& out) override {
        if (n > a.free_pages()) return false;
        out.resize(static_cast<size_t>(n));
        return a.alloc(n, out.data());
    }
    void free(const int32_t* pages, int64_t n) override { a.free(pages, n); }
};

struct PyPool final : radix::PagePool {
    PyObject* obj;  // borrowed: the PyTree holds the reference
    explicit PyPool(PyObject* o) : obj(o) {}
    int64_t free_pages() override { return py::handle(obj).attr("free_pages").cast<int64_t>(); }
    bool alloc(int64_t n, std::vector<int32_t>& out) override {
        py::object got = py::handle(obj).attr("alloc")(n);
        if (got.is_none()) return false;
        Int32View ids(got);
        out.assign(ids.data, ids.data + ids.size);
        return true;
    }
    void free(const int32_t* pages, int64_t n) override {
        py::handle(obj).attr("free")(to_array(pages, static_cast<size_t>(n)));
    }
};

struct PyTree {
    PyObject_HEAD
    Tree* tree;
    PyObject* match_type;   // radix_cache.MatchResult
    PyObject* insert_type;  // radix_cache.InsertResult
    PyObject* allocator;    // a C++ PageAllocator that evictions free into, or nullptr
    PageAllocator* cpp_allocator;
    std::vector<Node*>* path;          // scratch
    std::vector<int32_t>* released;  // scratch
    PyObject* host_allocator;        // the host tier's pool object, or nullptr
    radix::PagePool* host_pool;      // its adapter (owned)
};

PyTypeObject TreeType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyTree& self_tree(PyObject* self) { return *reinterpret_cast<PyTree*>(self); }

int tree_init(PyObject* self, PyObject* args, PyObject* kwargs) {
    static const char* names[] = {"page_size",      "match_type",    "insert_type", "allocator",
                                  "host_allocator", "write_through", nullptr};
    int page_size;
    int write_through = 0;
    PyObject *match_type, *insert_type, *allocator = Py_None, *host_allocator = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOO|OOp", const_cast<char**>(names),
                                     &page_size, &match_type, &insert_type, &allocator,
                                     &host_allocator, &write_through))
        return -1;
    PyTree& t = self_tree(self);
    if (t.tree) {
        PyErr_SetString(PyExc_RuntimeError, "RadixTree.__init__ called twice");
        return -1;
    }
    for (PyObject* type : {match_type, insert_type}) {
        if (!PyType_Check(type) ||
            !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "match_type and insert_type must be tuple types");
            return -1;
        }
    }
    PageAllocator* cpp_allocator = nullptr;
    if (allocator != Py_None) {
        PyObject* ok = guarded([&] {
            cpp_allocator = py::cast<PageAllocator*>(py::handle(allocator));
            Py_RETURN_NONE;
        });
        if (!ok) return -1;
        Py_DECREF(ok);
    }
    radix::PagePool* host_pool = nullptr;
    if (host_allocator != Py_None) {
        PyObject* ok = guarded([&] {
            PageAllocator* cpp_host = nullptr;
            try {
                cpp_host = py::cast<PageAllocator*>(py::handle(host_allocator));
            } catch (const py::cast_error&) {
            }
            if (cpp_host)
                host_pool = new CppPool(*cpp_host);
            else
                host_pool = new PyPool(host_allocator);
            Py_RETURN_NONE;
        });
        if (!ok) return -1;
        Py_DECREF(ok);
    }
    PyObject* ok = guarded([&] {
        t.tree = new Tree(page_size, host_pool, write_through != 0);
        t.path = new std::vector<Node*>();
        t.released = new std::vector<int32_t>();
        Py_RETURN_NONE;
    });
    if (!ok) {
        delete host_pool;
        return -1;
    }
    Py_DECREF(ok);
    if (host_pool) {
        Py_INCREF(host_allocator);
        t.host_allocator = host_allocator;
        t.host_pool = host_pool;
    }
    Py_INCREF(match_type);
    Py_INCREF(insert_type);
    t.match_type = match_type;
    t.insert_type = insert_type;
    if (cpp_allocator) {
        Py_INCREF(allocator);
        t.allocator = allocator;
        t.cpp_allocator = cpp_allocator;
    }
    return 0;
}

void tree_dealloc(PyObject* self) {
    PyTree& t = self_tree(self);
    delete t.tree;  // node handles still alive keep their (detached) nodes
    delete t.path;
    delete t.released;
    delete t.host_pool;
    Py_XDECREF(t.host_allocator);
    Py_XDECREF(t.match_type);
    Py_XDECREF(t.insert_type);
    Py_XDECREF(t.allocator);
    Py_TYPE(self)->tp_free(self);
}

Tree* tree_of(PyObject* self) {
    Tree* tree = self_tree(self).tree;
    if (!tree) PyErr_SetString(PyExc_RuntimeError, "RadixTree not initialised");
    return tree;
}

// type(*items) for a namedtuple type: what its __new__ does (tuple.__new__), without the call.
// Steals the items' references; they must all be non-null.
PyObject* new_namedtuple(PyObject* type, std::initializer_list<PyObject*> items) {
    auto* tp = reinterpret_cast<PyTypeObject*>(type);
    PyObject* out = tp->tp_alloc(tp, static_cast<Py_ssize_t>(items.size()));
    Py_ssize_t i = 0;
    for (PyObject* item : items) {
        if (out)
            PyTuple_SET_ITEM(out, i++, item);
        else
            Py_DECREF(item);
    }
    return out;
}

PyObject* tree_match_prefix(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                            PyObject* kwnames) {
    std::string ns;
    const std::string* ns_ptr;
    if (!namespace_arg("match_prefix", args, nargs, kwnames, 1, ns, &ns_ptr)) return nullptr;
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    PyTree& t = self_tree(self);
    return guarded([&]() -> PyObject* {
        Int32View view(args[0]);
        std::vector<Node*>& path = *t.path;
        const radix::Match m = tree->match_prefix(view.data, view.size, path, ns_ptr);
        int32_t* out;
        py::array pages = new_int32_array(m.length / tree->page_size(), &out);
        for (const Node* n : path) {  // host-only nodes hold no device pages
            std::memcpy(out, n->pages(), sizeof(int32_t) * n->num_pages());
            out += n->num_pages();
        }
        make_read_only(pages);
        PyObject* len = PyLong_FromLongLong(m.length);
        PyObject* h = handle(m.node);
        PyObject* host_len = PyLong_FromLongLong(m.host_length);
        PyObject* host_h = handle(m.host_node);
        if (!len || !h || !host_len || !host_h) {
            Py_XDECREF(len);
            Py_XDECREF(h);
            Py_XDECREF(host_len);
            Py_XDECREF(host_h);
            return nullptr;
        }
        return new_namedtuple(t.match_type, {pages.release().ptr(), len, h, host_len, host_h});
    });
}

PyObject* tree_insert(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                      PyObject* kwnames) {
    std::string ns;
    const std::string* ns_ptr;
    if (!namespace_arg("insert", args, nargs, kwnames, 2, ns, &ns_ptr)) return nullptr;
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    PyTree& t = self_tree(self);
    return guarded([&]() -> PyObject* {
        Int32View tokens(args[0]), pages(args[1]);
        int64_t prefix_len = 0;
        Node* node =
            tree->insert(tokens.data, tokens.size, pages.data, pages.size, prefix_len, ns_ptr);
        PyObject* len = PyLong_FromLongLong(prefix_len);
        PyObject* h = handle(node);
        if (!len || !h) {
            Py_XDECREF(len);
            Py_XDECREF(h);
            return nullptr;
        }
        return new_namedtuple(t.insert_type, {len, h});
    });
}

// lock(node) / unlock(node): one node argument, the tree method `op` on it
PyObject* node_call(const char* name, void (Tree::*op)(Node*), PyObject* self,
                    PyObject* const* args, Py_ssize_t nargs) {
    if (!check_nargs(name, nargs, 1)) return nullptr;
    Tree* tree = tree_of(self);
    Node* node = tree ? node_arg(args[0]) : nullptr;
    if (!node) return nullptr;
    return guarded([&] {
        (tree->*op)(node);
        Py_RETURN_NONE;
    });
}

PyObject* tree_lock(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    return node_call("lock", &Tree::lock, self, args, nargs);
}

PyObject* tree_unlock(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    return node_call("unlock", &Tree::unlock, self, args, nargs);
}

bool int_arg(PyObject* o, int64_t* out) {
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return false;
    *out = v;
    return true;
}

// evict(num_pages) -> (freed, pages, dropped): the caller returns `pages` (every device page
// freed) to its allocator; `dropped` holds those of the nodes that left the tree (None when none
// did), for the eviction observer.
PyObject* tree_evict(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    int64_t num_pages;
    if (!check_nargs("evict", nargs, 1) || !int_arg(args[0], &num_pages)) return nullptr;
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    PyTree& t = self_tree(self);
    return guarded([&] {
        t.released->clear();
        std::vector<int32_t> dropped;
        bool any_dropped = false;
        const int64_t freed = tree->evict(num_pages, *t.released, &dropped, &any_dropped);
        py::object gone = any_dropped ? py::object(to_array(dropped)) : py::object(py::none());
        return py::make_tuple(freed, to_array(*t.released), gone).release().ptr();
    });
}

// evict_host(num_pages) -> freed host pages (they go back to the host pool).
PyObject* tree_evict_host(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    int64_t num_pages;
    if (!check_nargs("evict_host", nargs, 1) || !int_arg(args[0], &num_pages)) return nullptr;
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    return guarded([&] {
        if (!tree->has_host()) throw std::runtime_error("the tree has no host tier");
        return PyLong_FromLongLong(tree->evict_host(num_pages));
    });
}

// load_back(node, pages) -> tokens loaded
PyObject* tree_load_back(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (!check_nargs("load_back", nargs, 2)) return nullptr;
    Tree* tree = tree_of(self);
    Node* node = tree ? node_arg(args[0]) : nullptr;
    if (!node) return nullptr;
    return guarded([&] {
        if (!tree->has_host()) throw std::runtime_error("the tree has no host tier");
        Int32View pages(args[1]);
        return PyLong_FromLongLong(tree->load_back(node, pages.data, pages.size));
    });
}

py::list copies_list(const std::vector<radix::Copy>& copies) {
    py::list out;
    for (const radix::Copy& c : copies) out.append(py::make_tuple(to_array(c.src), to_array(c.dst)));
    return out;
}

// take_copies() -> ([(src, dst)] writes, [(src, dst)] loads, writes_block)
PyObject* tree_take_copies(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    return guarded([&] {
        std::vector<radix::Copy> writes, loads;
        bool block = false;
        tree->take_copies(writes, loads, block);
        return py::make_tuple(copies_list(writes), copies_list(loads), block).release().ptr();
    });
}

// take_tier_events() -> [(kind, src, dst or None)], recorded while record_tier_events(True)
PyObject* tree_take_tier_events(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    return guarded([&] {
        static const char* kinds[] = {"offloaded", "loaded", "evicted_host"};
        py::list out;
        for (const radix::TierEvent& e : tree->take_tier_events()) {
            py::object dst = e.kind == radix::TierEvent::kEvictedHost
                                 ? py::object(py::none())
                                 : py::object(to_array(e.dst));
            out.append(py::make_tuple(kinds[e.kind], to_array(e.src), dst));
        }
        return out.release().ptr();
    });
}

PyObject* tree_record_tier_events(PyObject* self, PyObject* arg) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return nullptr;
    tree->record_tier_events(on != 0);
    Py_RETURN_NONE;
}

// evict_into(num_pages) -> freed: the pages go straight back to the C++ allocator that the
// tree was built with; no array crosses into Python.
PyObject* tree_evict_into(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    int64_t num_pages;
    if (!check_nargs("evict_into", nargs, 1) || !int_arg(args[0], &num_pages)) return nullptr;
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    PyTree& t = self_tree(self);
    if (!t.cpp_allocator) {
        PyErr_SetString(PyExc_RuntimeError, "the tree was built without a C++ allocator");
        return nullptr;
    }
    return guarded([&] {
        PageAllocator::Staged staged(*t.cpp_allocator);
        const int64_t freed = tree->evict(num_pages, staged);
        staged.finish();
        return PyLong_FromLongLong(freed);
    });
}

// reset() -> the pages to free; reset_into(): they go back to the tree's C++ allocator.
PyObject* tree_reset(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    PyTree& t = self_tree(self);
    return guarded([&] {
        t.released->clear();
        tree->reset(*t.released);
        return to_array(*t.released).release().ptr();
    });
}

PyObject* tree_reset_into(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    PyTree& t = self_tree(self);
    if (!t.cpp_allocator) {
        PyErr_SetString(PyExc_RuntimeError, "the tree was built without a C++ allocator");
        return nullptr;
    }
    return guarded([&] {
        t.released->clear();
        tree->reset(*t.released);
        t.cpp_allocator->free(t.released->data(), static_cast<int64_t>(t.released->size()));
        Py_RETURN_NONE;
    });
}

PyObject* tree_check_integrity(PyObject* self, PyObject* args, PyObject* kwargs) {
    static const char* names[] = {"expect_unlocked", nullptr};
    int expect_unlocked = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p", const_cast<char**>(names),
                                     &expect_unlocked))
        return nullptr;
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    return guarded([&] {
        tree->check_integrity(expect_unlocked != 0);
        Py_RETURN_NONE;
    });
}

// Every cached page id, in the Python tree's node order.
PyObject* tree_all_pages(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    return guarded([&] {
        std::vector<int32_t> pages;
        for (const Node* node : tree->nodes())
            pages.insert(pages.end(), node->pages(), node->pages() + node->num_pages());
        return to_array(pages).release().ptr();
    });
}

// Every host page held by a node, in node order.
PyObject* tree_all_host_pages(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    return guarded([&] {
        std::vector<int32_t> pages;
        for (const Node* node : tree->nodes())
            pages.insert(pages.end(), node->host_pages.begin(), node->host_pages.end());
        return to_array(pages).release().ptr();
    });
}

PyObject* tree_debug_clear_heap(PyObject* self, PyObject*) {
    Tree* tree = tree_of(self);
    if (!tree) return nullptr;
    tree->debug_clear_heap();
    Py_RETURN_NONE;
}

PyObject* tree_debug_add_evictable(PyObject* self, PyObject* arg) {
    Tree* tree = tree_of(self);
    int64_t n;
    if (!tree || !int_arg(arg, &n)) return nullptr;
    tree->debug_add_evictable(n);
    Py_RETURN_NONE;
}

PyMethodDef tree_methods[] = {
    {"match_prefix", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_match_prefix)),
     METH_FASTCALL | METH_KEYWORDS, "match_prefix(tokens, namespace=None) -> match_type(pages, length, node, host_length, host_node)"},
    {"insert", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_insert)),
     METH_FASTCALL | METH_KEYWORDS, "insert(tokens, pages, namespace=None) -> insert_type(prefix_len, node)"},
    {"lock", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_lock)),
     METH_FASTCALL, "lock(node)"},
    {"unlock", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_unlock)),
     METH_FASTCALL, "unlock(node)"},
    {"evict", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_evict)),
     METH_FASTCALL, "evict(num_pages) -> (freed, pages): the caller frees the pages"},
    {"evict_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_evict_into)),
     METH_FASTCALL, "evict_into(num_pages) -> freed, into the tree's C++ allocator"},
    {"evict_host", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_evict_host)),
     METH_FASTCALL, "evict_host(num_pages) -> freed host pages"},
    {"load_back", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_load_back)),
     METH_FASTCALL, "load_back(node, pages) -> tokens loaded"},
    {"take_copies", tree_take_copies, METH_NOARGS,
     "take_copies() -> (writes, loads, writes_block), copies as (src, dst) pairs"},
    {"take_tier_events", tree_take_tier_events, METH_NOARGS,
     "the tier events recorded since the last call: [(kind, src, dst or None)]"},
    {"record_tier_events", tree_record_tier_events, METH_O, "record_tier_events(on)"},
    {"all_host_pages", tree_all_host_pages, METH_NOARGS, "every host page id, in node order"},
    {"reset", tree_reset, METH_NOARGS, "drop every node -> the device pages to free"},
    {"reset_into", tree_reset_into, METH_NOARGS, "drop every node, freeing into the allocator"},
    {"check_integrity",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tree_check_integrity)),
     METH_VARARGS | METH_KEYWORDS, "check_integrity(expect_unlocked=False)"},
    {"all_pages", tree_all_pages, METH_NOARGS, "every cached page id, in node order"},
    {"_debug_clear_heap", tree_debug_clear_heap, METH_NOARGS, nullptr},
    {"_debug_add_evictable", tree_debug_add_evictable, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

#define TREE_INT_GETTER(name, expr)                     \
    PyObject* tree_get_##name(PyObject* self, void*) {  \
        Tree* tree = tree_of(self);                     \
        if (!tree) return nullptr;                      \
        return PyLong_FromLongLong(expr);               \
    }
TREE_INT_GETTER(page_size, tree->page_size())
TREE_INT_GETTER(evictable_pages, tree->evictable_pages())
TREE_INT_GETTER(protected_pages, tree->protected_pages())
TREE_INT_GETTER(num_nodes, tree->num_nodes())
TREE_INT_GETTER(heap_size, static_cast<long long>(tree->heap_size()))
TREE_INT_GETTER(host_cached_pages, tree->host_cached_pages())
TREE_INT_GETTER(host_evictable_pages, tree->host_evictable_pages())
TREE_INT_GETTER(host_heap_size, static_cast<long long>(tree->host_heap_size()))
TREE_INT_GETTER(copy_heap_size, static_cast<long long>(tree->copy_heap_size()))
#undef TREE_INT_GETTER

PyObject* tree_get_root(PyObject* self, void*) {
    Tree* tree = tree_of(self);
    return tree ? handle(tree->root().get()) : nullptr;
}

PyGetSetDef tree_getset[] = {
    {"page_size", tree_get_page_size, nullptr, nullptr, nullptr},
    {"root", tree_get_root, nullptr, nullptr, nullptr},
    {"evictable_pages", tree_get_evictable_pages, nullptr, nullptr, nullptr},
    {"protected_pages", tree_get_protected_pages, nullptr, nullptr, nullptr},
    {"num_nodes", tree_get_num_nodes, nullptr, nullptr, nullptr},
    {"heap_size", tree_get_heap_size, nullptr, nullptr, nullptr},
    {"host_cached_pages", tree_get_host_cached_pages, nullptr, nullptr, nullptr},
    {"host_evictable_pages", tree_get_host_evictable_pages, nullptr, nullptr, nullptr},
    {"host_heap_size", tree_get_host_heap_size, nullptr, nullptr, nullptr},
    {"copy_heap_size", tree_get_copy_heap_size, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

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

void add_type(py::module_& m, PyTypeObject& type, const char* name) {
    if (PyType_Ready(&type) < 0) throw py::error_already_set();
    Py_INCREF(&type);
    m.attr(name) = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&type));
}

}  // namespace

PYBIND11_MODULE(_radix_tree, m) {
    m.doc() = "The radix tree of KV-cache pages and the page allocator in C++ (csrc/)";
    integrity_error =
        py::register_exception<radix::IntegrityError>(m, "IntegrityError", PyExc_AssertionError)
            .ptr();

    NodeType.tp_name = "radix_runtime.scheduler._radix_tree.TreeNode";
    NodeType.tp_basicsize = sizeof(PyNode);
    NodeType.tp_flags = Py_TPFLAGS_DEFAULT;
    NodeType.tp_doc = "A node of the C++ radix tree (handles come from the tree)";
    NodeType.tp_dealloc = node_dealloc;
    NodeType.tp_repr = node_repr;
    NodeType.tp_getset = node_getset;
    add_type(m, NodeType, "TreeNode");

    TreeType.tp_name = "radix_runtime.scheduler._radix_tree.RadixTree";
    TreeType.tp_basicsize = sizeof(PyTree);
    TreeType.tp_flags = Py_TPFLAGS_DEFAULT;
    TreeType.tp_doc =
        "RadixTree(page_size, match_type, insert_type, allocator=None, host_allocator=None, "
        "write_through=False): the C++ radix tree; `allocator`, a C++ PageAllocator, is where "
        "evict_into / reset_into free pages; `host_allocator` (a C++ or Python allocator) is the "
        "host tier's pool";
    TreeType.tp_new = PyType_GenericNew;
    TreeType.tp_init = tree_init;
    TreeType.tp_dealloc = tree_dealloc;
    TreeType.tp_methods = tree_methods;
    TreeType.tp_getset = tree_getset;
    add_type(m, TreeType, "RadixTree");

    // module_local: pybind11's type registry is per process, so two builds of this extension
    // (say, an A/B benchmark of two versions) can then be loaded side by side.
    py::class_<PageAllocator>(m, "PageAllocator", py::module_local())
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
