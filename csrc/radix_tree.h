// The radix tree of KV-cache pages in C++: the twin of radix_runtime/scheduler/radix_cache.py.
//
// The Python file is the readable reference and this is a line-for-line port of its algorithm:
// the same node ids, the same LRU clock (one tick per match or insert), the same evictable-leaf
// heap with lazy deletion, and the same children insertion order, so both trees split, evict and
// free pages in exactly the same order (tests/unit/test_radix_cache_cpp.py checks that).
//
// No Python here: bindings.cpp converts numpy buffers and raises the Python exceptions.
// Errors are thrown as std::invalid_argument (ValueError), std::runtime_error (RuntimeError)
// and radix::IntegrityError (an AssertionError subclass).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace radix {

struct IntegrityError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Node;
using NodePtr = std::shared_ptr<Node>;

// Where an eviction puts the pages of each node it drops, in eviction order.
struct PageSink {
    virtual void put(const int32_t* pages, int64_t n) = 0;

protected:
    ~PageSink() = default;
};

// The hash of one page (page_size tokens): children are found by their first page.
uint64_t hash_page(const int32_t* tokens, int32_t page_size) noexcept;

// A node's children, found by their first page. Few children (the common case: a conversation's
// turns form chains) live in a flat array that a lookup scans by hash: one cache line, not a
// hash table's bucket array plus a list node. Past kSmall children a hash multimap takes over.
// Hashes are compared first and the first page's tokens after, so collisions are harmless.
class Children {
public:
    static constexpr size_t kSmall = 8;

    // The child whose key starts with the page `first` (whose hash is `hash`), or nullptr.
    Node* find(const int32_t* first, uint64_t hash, int32_t page_size) const;
    // Files `child` under `hash`, the hash of its first page (kept in child->first_hash).
    void add(uint64_t hash, NodePtr child);
    // Removes `child` and returns the owning pointer.
    NodePtr take(const Node* child);
    size_t size() const { return map_ ? map_->size() : small_.size(); }
    bool empty() const { return size() == 0; }
    void clear() {
        small_.clear();
        map_.reset();
    }
    template <typename F>
    void for_each(F&& f) const {  // in no particular order
        if (map_)
            for (const auto& kv : *map_) f(kv.second.get());
        else
            for (const auto& e : small_) f(e.node.get());
    }

private:
    struct Entry {
        uint64_t hash;
        NodePtr node;
    };
    std::vector<Entry> small_;
    std::unique_ptr<std::unordered_multimap<uint64_t, NodePtr>> map_;
};

// NOTE: nodes are shared_ptrs so that a handle Python still holds (a request's locked node, an
// evicted node in a stale heap entry) stays valid memory after the tree lets go of it; an
// evicted node is recognised by parent == nullptr, exactly as in the Python tree.
struct Node : std::enable_shared_from_this<Node> {
private:
    // First, with `children`: the fields that a walk reads, on the node's first cache line.
    int32_t* block_ = nullptr;
    int64_t key_len_ = 0;
    int64_t num_pages_ = 0;

public:
    // The hash of the first page of the key, as filed in the parent's children (so that an
    // eviction unlinks a node without reading its tokens).
    uint64_t first_hash = 0;

    Node(int32_t page_size, int64_t id);
    ~Node();
    Node(const Node&) = delete;
    Node& operator=(const Node&) = delete;

    // The edge: its tokens (a multiple of page_size) and their page ids, in ONE heap block
    // (tokens, then pages), so that a walk down the tree touches one allocation per edge and
    // a match's page copy streams on from the compared tokens.
    const int32_t* key() const { return block_; }
    int64_t key_len() const { return key_len_; }
    const int32_t* pages() const { return block_ + key_len_; }
    int64_t num_pages() const { return num_pages_; }
    void set_edge(const int32_t* key, int64_t key_len, const int32_t* pages, int64_t num_pages);
    void set_pages(const int32_t* pages, int64_t num_pages);  // keeps the key (tests corrupt it)
    // Drops the first `tokens` tokens and `pages` pages (the lower half of a split), in place.
    void drop_front(int64_t tokens, int64_t pages);

    Children children;
    Node* parent = nullptr;  // nullptr for the root and for evicted nodes
    int64_t lock_ref = 0;
    int64_t last_access = 0;  // LRU stamp; a parent's is always >= its children's
    int64_t id;               // LRU tie-break, and a stable name in dumps
    int64_t heap_time = -1;   // last_access of this node's newest heap entry, -1 if none
    // Position among the parent's children: Python dicts iterate in insertion order, and reset()
    // frees pages in that order, so the twin keeps it to free the same pages in the same order.
    uint64_t order = 0;
    uint64_t next_child_order = 0;
    int32_t page_size;
    // A namespace node (a child of the root holding no tokens, where a salted namespace's
    // prefixes start) has its name here; nullptr for every other node.
    std::unique_ptr<std::string> ns;
    // The root only: its namespace nodes by name (nullptr until the first one). They are the
    // root's children too (ordered_children() and `order` mix them with the token children).
    std::unique_ptr<std::map<std::string, NodePtr>> namespaces;
    // The bindings' Python handle of this node while one exists (a borrowed pointer that the
    // handle clears when it dies), so that a node always has the same Python object.
    void* py_handle = nullptr;

    bool is_namespace() const { return ns != nullptr; }
    bool has_children() const {
        return !children.empty() || (namespaces && !namespaces->empty());
    }
    std::vector<Node*> ordered_children() const;  // namespace nodes included
    std::string repr() const;
};

class Tree {
public:
    explicit Tree(int32_t page_size);
    ~Tree();
    Tree(const Tree&) = delete;
    Tree& operator=(const Tree&) = delete;

    // Longest cached page-aligned prefix of tokens[0:n] in namespace `ns` (nullptr: the public
    // one). Fills `path` with the matched token nodes (top-down) and returns the deepest node;
    // `length` gets the matched tokens.
    Node* match_prefix(const int32_t* tokens, int64_t n, std::vector<Node*>& path,
                       int64_t& length, const std::string* ns = nullptr);
    // Cache tokens[0:n]'s page-aligned part with `pages` (n / page_size of them) in namespace
    // `ns`; returns the node ending at the key's end, and the tokens that were already cached
    // in `prefix_len`.
    Node* insert(const int32_t* tokens, int64_t n, const int32_t* pages, int64_t num_pages,
                 int64_t& prefix_len, const std::string* ns = nullptr);
    void lock(Node* node);
    void unlock(Node* node);
    // Evicts LRU unlocked leaves until `num_pages` are freed; appends their pages to `released`.
    int64_t evict(int64_t num_pages, std::vector<int32_t>& released);
    // The same, handing each evicted node's pages to `sink` (e.g. straight to an allocator).
    int64_t evict(int64_t num_pages, PageSink& sink);
    // Drops every node; appends all cached pages to `released` (in the Python tree's order).
    void reset(std::vector<int32_t>& released);
    // Tree structure, counters and heap (the allocator side is checked by the Python wrapper).
    void check_integrity(bool expect_unlocked) const;
    // Every node except the root, parents before children, in the Python tree's _nodes() order.
    std::vector<Node*> nodes() const;

    int32_t page_size() const { return page_size_; }
    const NodePtr& root() const { return root_; }
    int64_t evictable_pages() const { return evictable_; }
    int64_t protected_pages() const { return protected_; }
    int64_t num_nodes() const { return num_nodes_; }
    size_t heap_size() const { return heap_.size(); }

    // Test hooks: corrupt the state so that check_integrity must notice.
    void debug_clear_heap() { heap_.clear(); }
    void debug_add_evictable(int64_t n) { evictable_ += n; }

private:
    struct HeapEntry {
        int64_t time;
        int64_t id;
        NodePtr node;
    };
    // std::push_heap builds a max-heap; "greater" makes it a min-heap on (time, id).
    struct Later {
        bool operator()(const HeapEntry& a, const HeapEntry& b) const {
            return a.time != b.time ? a.time > b.time : a.id > b.id;
        }
    };

    NodePtr new_node();
    void new_tree();
    void dismantle();
    Node* walk(Node* start, const int32_t* tokens, int64_t num_pages, std::vector<Node*>* path,
               int64_t& length);
    // Where a walk in `ns` starts: the root for nullptr, else the namespace node (made when
    // `create`; nullptr when it does not exist).
    Node* namespace_node(const std::string* ns, bool create);
    void tick_root();  // what a walk that finds no namespace node does
    void unlink(Node* node);  // takes `node` out of its parent's children
    uint64_t hash_of(const int32_t* page) const { return hash_page(page, page_size_); }
    Node* split(Node* child, int64_t at);
    void push_if_evictable_leaf(Node* node);
    static bool entry_is_live(const HeapEntry& e);
    void compact_heap();

    int32_t page_size_;
    int64_t next_id_ = 0;
    int64_t clock_ = 0;
    NodePtr root_;
    int64_t evictable_ = 0;
    int64_t protected_ = 0;
    int64_t num_nodes_ = 0;  // excluding the root
    std::vector<HeapEntry> heap_;
    size_t heap_limit_ = 1024;
};

}  // namespace radix
