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
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace radix {

struct IntegrityError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A child's key in its parent's map: the first page (page_size tokens) of the child's edge.
// It points into the child's own `key`, so the map entry is re-keyed whenever that key changes.
struct PageKey {
    const int32_t* tokens;
};

struct PageHash {
    int32_t page_size;
    size_t operator()(const PageKey& k) const noexcept;
};

struct PageEq {
    int32_t page_size;
    bool operator()(const PageKey& a, const PageKey& b) const noexcept;
};

struct Node;
using NodePtr = std::shared_ptr<Node>;
using ChildMap = std::unordered_map<PageKey, NodePtr, PageHash, PageEq>;

// NOTE: nodes are shared_ptrs so that a handle Python still holds (a request's locked node, an
// evicted node in a stale heap entry) stays valid memory after the tree lets go of it; an
// evicted node is recognised by parent == nullptr, exactly as in the Python tree.
struct Node : std::enable_shared_from_this<Node> {
    Node(int32_t page_size, int64_t id);

    std::vector<int32_t> key;    // the edge's tokens, a multiple of page_size
    std::vector<int32_t> pages;  // key.size() / page_size page ids
    ChildMap children;
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

    std::vector<Node*> ordered_children() const;
    std::string repr() const;
};

class Tree {
public:
    explicit Tree(int32_t page_size);
    ~Tree();
    Tree(const Tree&) = delete;
    Tree& operator=(const Tree&) = delete;

    // Longest cached page-aligned prefix of tokens[0:n]. Fills `path` with the matched nodes
    // (root excluded, top-down) and returns the deepest one; `length` gets the matched tokens.
    Node* match_prefix(const int32_t* tokens, int64_t n, std::vector<Node*>& path,
                       int64_t& length);
    // Cache tokens[0:n]'s page-aligned part with `pages` (n / page_size of them); returns the
    // node ending at the key's end, and the tokens that were already cached in `prefix_len`.
    Node* insert(const int32_t* tokens, int64_t n, const int32_t* pages, int64_t num_pages,
                 int64_t& prefix_len);
    void lock(Node* node);
    void unlock(Node* node);
    // Evicts LRU unlocked leaves until `num_pages` are freed; appends their pages to `released`.
    int64_t evict(int64_t num_pages, std::vector<int32_t>& released);
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
    Node* walk(const int32_t* tokens, int64_t num_pages, std::vector<Node*>* path,
               int64_t& length);
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
