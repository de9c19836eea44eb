// The radix tree of KV-cache pages in C++: the twin of radix_runtime/scheduler/radix_cache.py.
//
// The Python file is the readable reference and this is a line-for-line port of its algorithm:
// the same node ids, the same LRU clock (one tick per match or insert), the same evictable-leaf
// heap with lazy deletion, and the same children insertion order, so both trees split, evict and
// free pages in exactly the same order (tests/unit/test_radix_cache_cpp.py checks that).
//
// The host tier (--enable-hierarchical-cache, docs/hicache.md) is in the same tree: a node's KV
// lives on the device (its pages), in the host pool (its host pages), or both; the device nodes
// form a prefix-closed subtree. Device eviction keeps a node on the host, host eviction drops
// host-only leaves, and the tree queues the copies (take_copies) instead of making them.
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

// Where an eviction puts the device pages it frees: the offloaded nodes' first, then each
// dropped node's, in eviction order.
struct PageSink {
    virtual void put(const int32_t* pages, int64_t n) = 0;
    // The pages of a node that left the tree (put() is for those of nodes kept on the host).
    virtual void put_dropped(const int32_t* pages, int64_t n) { put(pages, n); }

protected:
    ~PageSink() = default;
};

// A pool of pages the tree allocates from and frees into itself: the host tier's pool (the
// bindings adapt the C++ PageAllocator or a Python allocator object to it).
struct PagePool {
    virtual int64_t free_pages() = 0;
    // `n` page ids into `out` (replacing its contents), or false when fewer than `n` are free.
    virtual bool alloc(int64_t n, std::vector<int32_t>& out) = 0;
    virtual void free(const int32_t* pages, int64_t n) = 0;
    virtual ~PagePool() = default;
};

// A copy between the pools that the worker makes: page ids, one per page, src to dst.
struct Copy {
    std::vector<int32_t> src, dst;
};

// KV that moved between the tiers or left the host (the tier observer's events, in order).
struct TierEvent {
    enum Kind { kOffloaded, kLoaded, kEvictedHost } kind;
    std::vector<int32_t> src, dst;  // dst is empty for kEvictedHost
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

    // The host tier: this node's host page ids when `on_host` (then num_pages() is 0 if the
    // node is on the host only), the number of its children on the device (namespace nodes
    // count as on the device), and host_heap_time, as heap_time for the host-leaf heap.
    bool on_host = false;
    std::vector<int32_t> host_pages;
    int64_t dev_children = 0;
    int64_t host_heap_time = -1;
    bool in_copy_heap = false;  // has an entry in the heap of host copies of device nodes
    bool load_pending = false;  // a load into it is queued and not taken yet

    // The root and namespace nodes (no tokens) count as on the device.
    bool on_device() const { return num_pages_ > 0 || key_len_ == 0; }
    bool is_namespace() const { return ns != nullptr; }
    bool has_children() const {
        return !children.empty() || (namespaces && !namespaces->empty());
    }
    std::vector<Node*> ordered_children() const;  // namespace nodes included
    std::string repr() const;
};

// What a match found: the device run (`node`, `length`) and, with a host tier, the host-only
// run after it (`host_node`, `host_length`); host_node is `node` when nothing matched on the
// host and nullptr when the namespace does not exist.
struct Match {
    Node* node;
    int64_t length;
    Node* host_node;
    int64_t host_length;
};

class Tree {
public:
    // `host`: the host tier's pool (not owned; nullptr: one tier).
    explicit Tree(int32_t page_size, PagePool* host = nullptr, bool write_through = false);
    ~Tree();
    Tree(const Tree&) = delete;
    Tree& operator=(const Tree&) = delete;

    // Longest cached page-aligned prefix of tokens[0:n] in namespace `ns` (nullptr: the public
    // one). Fills `path` with the matched token nodes (top-down; host-only ones hold no pages).
    Match match_prefix(const int32_t* tokens, int64_t n, std::vector<Node*>& path,
                       const std::string* ns = nullptr);
    // Cache tokens[0:n]'s page-aligned part with `pages` (n / page_size of them) in namespace
    // `ns`; returns the node ending at the key's end, and the tokens that were already cached
    // in `prefix_len`.
    Node* insert(const int32_t* tokens, int64_t n, const int32_t* pages, int64_t num_pages,
                 int64_t& prefix_len, const std::string* ns = nullptr);
    void lock(Node* node);
    void unlock(Node* node);
    // Evicts LRU unlocked device leaves until `num_pages` device pages are freed (with a host
    // tier a node is kept on the host when it has or gets a host copy); appends every freed
    // device page to `freed_pages` (the offloaded nodes' first, then the dropped nodes'), and
    // the dropped nodes' pages to `dropped` when given; `any_dropped` tells whether a node left.
    int64_t evict(int64_t num_pages, std::vector<int32_t>& freed_pages,
                  std::vector<int32_t>* dropped = nullptr, bool* any_dropped = nullptr);
    // The same, handing the freed device pages to `sink` (e.g. straight to an allocator).
    int64_t evict(int64_t num_pages, PageSink& sink);
    // Frees at least `num_pages` host pages: LRU unlocked host-only leaves leave the tree.
    int64_t evict_host(int64_t num_pages);
    // Gives the host-only nodes on the path to `node` (locked) the device pages `pages` and
    // queues their loads; returns the tokens loaded.
    int64_t load_back(Node* node, const int32_t* pages, int64_t num_pages);
    // The copies queued since the last call (writes device->host, loads host->device) and
    // whether the step must wait for the writes (their device pages were freed).
    void take_copies(std::vector<Copy>& writes, std::vector<Copy>& loads, bool& writes_block);
    // Drops every node; appends all cached device pages to `released` (in the Python tree's
    // order) and frees the host pages into the host pool.
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
    bool has_host() const { return host_ != nullptr; }
    bool write_through() const { return write_through_; }
    int64_t host_cached_pages() const { return host_cached_; }
    int64_t host_evictable_pages() const { return host_evictable_; }
    size_t host_heap_size() const { return host_heap_.size(); }
    size_t copy_heap_size() const { return copy_heap_.size(); }
    // Tier events are recorded only while asked for (a tier observer is set).
    void record_tier_events(bool on) { record_tier_ = on; }
    std::vector<TierEvent> take_tier_events() { return std::move(tier_events_); }

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
    // the host tier
    std::vector<Node*> host_only_path(Node* node) const;
    int64_t to_device(Node* node, const int32_t* pages, int64_t num_pages, bool copy, bool tail);
    bool write_to_host(Node* node);
    void remove(Node* node);  // a device node leaves the tree with its host-only subtree
    void push_host_leaf(Node* node);
    void push_copy(Node* node);  // a node on both tiers: its host copy may be dropped
    static bool host_entry_is_live(const HeapEntry& e);
    void tier_event(TierEvent::Kind kind, const int32_t* src, int64_t n, const int32_t* dst);

    int32_t page_size_;
    int64_t next_id_ = 0;
    int64_t clock_ = 0;
    NodePtr root_;
    int64_t evictable_ = 0;
    int64_t protected_ = 0;
    int64_t num_nodes_ = 0;  // excluding the root
    std::vector<HeapEntry> heap_;
    size_t heap_limit_ = 1024;
    // the host tier
    PagePool* host_;
    bool write_through_;
    std::vector<HeapEntry> host_heap_;
    size_t host_heap_limit_ = 1024;
    // NOTE: one entry per node at most (Node::in_copy_heap); an entry whose node was used since
    // is pushed again with its new stamp when it reaches the top (exact LRU, lazily)
    std::vector<HeapEntry> copy_heap_;
    size_t copy_heap_limit_ = 1024;
    std::vector<NodePtr> loading_;  // the nodes of the queued loads
    int64_t host_cached_ = 0;     // host pages held by nodes
    int64_t host_evictable_ = 0;  // host pages of unlocked host-only nodes
    std::vector<Copy> writes_, loads_;
    bool writes_block_ = false;
    bool record_tier_ = false;
    std::vector<TierEvent> tier_events_;
};

}  // namespace radix
