// The radix tree of KV-cache pages; see radix_tree.h and radix_runtime/scheduler/radix_cache.py
// (the reference: every function here has a same-named twin there).
#include "radix_tree.h"

#include <algorithm>
#include <cstring>

namespace radix {

namespace {

void fail(const std::string& message) { throw IntegrityError(message); }

}  // namespace

size_t PageHash::operator()(const PageKey& k) const noexcept {
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (int32_t i = 0; i < page_size; ++i) {
        h ^= static_cast<uint32_t>(k.tokens[i]);
        h *= 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    return static_cast<size_t>(h);
}

bool PageEq::operator()(const PageKey& a, const PageKey& b) const noexcept {
    return std::memcmp(a.tokens, b.tokens, sizeof(int32_t) * page_size) == 0;
}

Node::Node(int32_t page_size_, int64_t id_)
    : children(0, PageHash{page_size_}, PageEq{page_size_}), id(id_), page_size(page_size_) {}

std::vector<Node*> Node::ordered_children() const {
    std::vector<Node*> out;
    out.reserve(children.size());
    for (const auto& kv : children) out.push_back(kv.second.get());
    std::sort(out.begin(), out.end(), [](Node* a, Node* b) { return a->order < b->order; });
    return out;
}

std::string Node::repr() const {
    return "TreeNode(id=" + std::to_string(id) + ", tokens=" + std::to_string(key.size()) +
           ", pages=" + std::to_string(pages.size()) + ", lock_ref=" + std::to_string(lock_ref) +
           ", last_access=" + std::to_string(last_access) + ")";
}

// ------------------------------------------------------------------------------- the tree

Tree::Tree(int32_t page_size) : page_size_(page_size) {
    if (page_size < 1)
        throw std::invalid_argument("page_size must be >= 1, got " + std::to_string(page_size));
    new_tree();
}

Tree::~Tree() { dismantle(); }

NodePtr Tree::new_node() { return std::make_shared<Node>(page_size_, next_id_++); }

void Tree::new_tree() {
    root_ = new_node();
    evictable_ = protected_ = num_nodes_ = 0;
    heap_.clear();
    heap_limit_ = 1024;
}

// NOTE: a long chain of nodes would destroy itself recursively (each shared_ptr's destructor
// runs its children's); detach everything first so that every node dies alone.
void Tree::dismantle() {
    std::vector<NodePtr> all;
    std::vector<Node*> stack{root_.get()};
    while (!stack.empty()) {
        Node* node = stack.back();
        stack.pop_back();
        for (auto& kv : node->children) {
            stack.push_back(kv.second.get());
            all.push_back(kv.second);
        }
    }
    for (auto& node : all) {
        node->parent = nullptr;
        node->children.clear();
    }
    root_->children.clear();
    heap_.clear();
}

// ------------------------------------------------------------------------- match / insert

Node* Tree::match_prefix(const int32_t* tokens, int64_t n, std::vector<Node*>& path,
                         int64_t& length) {
    path.clear();
    Node* node = walk(tokens, n / page_size_, &path, length);
    push_if_evictable_leaf(node);
    return node;
}

Node* Tree::insert(const int32_t* tokens, int64_t n, const int32_t* pages, int64_t num_pages,
                   int64_t& prefix_len) {
    const int64_t ps = page_size_;
    const int64_t want = n / ps;
    if (num_pages != want)
        throw std::invalid_argument(std::to_string(n) + " tokens need " + std::to_string(want) +
                                    " pages, got " + std::to_string(num_pages));
    Node* node = walk(tokens, want, nullptr, prefix_len);
    if (prefix_len < want * ps) {
        NodePtr leaf = new_node();
        leaf->key.assign(tokens + prefix_len, tokens + want * ps);
        leaf->pages.assign(pages + prefix_len / ps, pages + want);
        leaf->parent = node;
        leaf->last_access = clock_;
        leaf->order = node->next_child_order++;
        Node* raw = leaf.get();
        node->children.emplace(PageKey{raw->key.data()}, std::move(leaf));
        ++num_nodes_;
        evictable_ += static_cast<int64_t>(raw->pages.size());
        node = raw;
    }
    push_if_evictable_leaf(node);
    return node;
}

Node* Tree::walk(const int32_t* tokens, int64_t num_pages, std::vector<Node*>* path,
                 int64_t& length) {
    const int64_t ps = page_size_;
    const int64_t now = ++clock_;
    Node* node = root_.get();
    node->last_access = now;
    const int64_t end = num_pages * ps;
    int64_t off = 0;
    while (off < end) {
        auto it = node->children.find(PageKey{tokens + off});
        if (it == node->children.end()) break;
        Node* child = it->second.get();
        const int64_t key_len = static_cast<int64_t>(child->key.size());
        const int64_t m = std::min(key_len, end - off);
        int64_t matched;
        if (std::memcmp(child->key.data(), tokens + off, sizeof(int32_t) * m) == 0) {
            matched = m;  // the common case: the whole edge (or the whole rest of the query)
        } else {
            // The child key guarantees that the first page matches, so `first` >= page_size.
            const int32_t* key = child->key.data();
            const int32_t* query = tokens + off;
            int64_t first = 0;
            while (key[first] == query[first]) ++first;
            matched = first / ps * ps;
        }
        if (matched < key_len) child = split(child, matched);
        child->last_access = now;
        if (path) path->push_back(child);
        off += matched;
        node = child;
        if (matched < key_len) break;
    }
    length = off;
    return node;
}

Node* Tree::split(Node* child, int64_t at) {
    const int64_t ps = page_size_;
    Node* parent = child->parent;
    auto it = parent->children.find(PageKey{child->key.data()});
    NodePtr lower = std::move(it->second);
    parent->children.erase(it);

    NodePtr upper = new_node();
    upper->key.assign(child->key.begin(), child->key.begin() + at);
    upper->pages.assign(child->pages.begin(), child->pages.begin() + at / ps);
    upper->parent = parent;
    upper->lock_ref = child->lock_ref;
    upper->last_access = child->last_access;
    upper->order = child->order;  // the upper part takes the child's place among its siblings

    // The lower part keeps its identity (handles, lock counts and heap entries stay valid).
    child->key.erase(child->key.begin(), child->key.begin() + at);
    child->pages.erase(child->pages.begin(), child->pages.begin() + at / ps);
    child->parent = upper.get();
    child->order = upper->next_child_order++;
    upper->children.emplace(PageKey{child->key.data()}, std::move(lower));

    Node* raw = upper.get();
    parent->children.emplace(PageKey{raw->key.data()}, std::move(upper));
    ++num_nodes_;
    return raw;
}

// ---------------------------------------------------------------------------------- locks

void Tree::lock(Node* node) {
    Node* root = root_.get();
    if (node == root) return;
    if (node->parent == nullptr)
        throw std::invalid_argument("lock of an evicted node " + node->repr());
    for (; node != root; node = node->parent) {
        if (node->lock_ref == 0) {
            const int64_t size = static_cast<int64_t>(node->pages.size());
            evictable_ -= size;
            protected_ += size;
        }
        ++node->lock_ref;
    }
}

void Tree::unlock(Node* node) {
    Node* root = root_.get();
    if (node == root) return;
    // NOTE: a parent's lock_ref >= its child's, so checking the start checks the whole path.
    if (node->lock_ref <= 0)
        throw std::runtime_error("unlock of an unlocked node " + node->repr());
    Node* start = node;
    for (; node != root; node = node->parent) {
        if (--node->lock_ref == 0) {
            const int64_t size = static_cast<int64_t>(node->pages.size());
            protected_ -= size;
            evictable_ += size;
        }
    }
    push_if_evictable_leaf(start);  // only the start can be a leaf
}

// ------------------------------------------------------------------------------- eviction

void Tree::push_if_evictable_leaf(Node* node) {
    if (!node->children.empty() || node->lock_ref || node == root_.get()) return;
    if (node->heap_time == node->last_access) return;  // its live entry is already in the heap
    node->heap_time = node->last_access;
    heap_.push_back({node->last_access, node->id, node->shared_from_this()});
    std::push_heap(heap_.begin(), heap_.end(), Later{});
    if (heap_.size() > heap_limit_) compact_heap();
}

bool Tree::entry_is_live(const HeapEntry& e) {
    const Node* node = e.node.get();
    return e.time == node->last_access && node->lock_ref == 0 && node->children.empty() &&
           node->parent != nullptr;
}

void Tree::compact_heap() {
    std::vector<HeapEntry> live;
    for (auto& entry : heap_) {
        if (entry_is_live(entry))
            live.push_back(std::move(entry));
        else if (entry.time == entry.node->heap_time)
            entry.node->heap_time = -1;
    }
    std::make_heap(live.begin(), live.end(), Later{});
    heap_ = std::move(live);
    heap_limit_ = std::max<size_t>(1024, 2 * heap_.size());
}

int64_t Tree::evict(int64_t num_pages, std::vector<int32_t>& released) {
    int64_t freed = 0;
    while (freed < num_pages && !heap_.empty()) {
        std::pop_heap(heap_.begin(), heap_.end(), Later{});
        HeapEntry entry = std::move(heap_.back());
        heap_.pop_back();
        Node* node = entry.node.get();
        if (entry.time == node->heap_time) node->heap_time = -1;
        if (!entry_is_live(entry)) continue;
        Node* parent = node->parent;
        parent->children.erase(PageKey{node->key.data()});  // `entry` keeps the node alive
        node->parent = nullptr;
        --num_nodes_;
        const int64_t size = static_cast<int64_t>(node->pages.size());
        evictable_ -= size;
        freed += size;
        released.insert(released.end(), node->pages.begin(), node->pages.end());
        push_if_evictable_leaf(parent);
    }
    return freed;
}

void Tree::reset(std::vector<int32_t>& released) {
    bool locked = protected_ != 0;
    for (const auto& kv : root_->children) locked = locked || kv.second->lock_ref != 0;
    if (locked) throw std::runtime_error("reset of the radix cache while nodes are locked");
    for (Node* node : nodes())
        released.insert(released.end(), node->pages.begin(), node->pages.end());
    dismantle();
    new_tree();
}

// ------------------------------------------------------------------------------ debugging

std::vector<Node*> Tree::nodes() const {
    std::vector<Node*> out;
    std::vector<Node*> stack = root_->ordered_children();
    while (!stack.empty()) {
        Node* node = stack.back();
        stack.pop_back();
        out.push_back(node);
        for (Node* child : node->ordered_children()) stack.push_back(child);
    }
    return out;
}

void Tree::check_integrity(bool expect_unlocked) const {
    const int64_t ps = page_size_;
    const Node* root = root_.get();
    if (root->parent || !root->key.empty() || !root->pages.empty()) fail("bad root");
    if (root->lock_ref != 0) fail("root lock_ref " + std::to_string(root->lock_ref) + " != 0");
    const std::vector<Node*> all = nodes();
    if (static_cast<int64_t>(all.size()) != num_nodes_)
        fail("node count " + std::to_string(num_nodes_) + " != " + std::to_string(all.size()));
    int64_t evictable = 0, protected_pages = 0;
    std::vector<const Node*> leaves;
    for (const Node* node : all) {
        const Node* parent = node->parent;
        const std::string name = node->repr();
        const int64_t key_len = static_cast<int64_t>(node->key.size());
        if (!parent) fail(name + " in the tree has no parent");
        if (key_len == 0) fail("empty non-root node " + name);
        if (key_len % ps) fail(name + " key is not page-aligned");
        if (static_cast<int64_t>(node->pages.size()) != key_len / ps)
            fail(name + " pages/key length mismatch");
        auto it = parent->children.find(PageKey{node->key.data()});
        if (it == parent->children.end() || it->second.get() != node)
            fail(name + " is not under its first " + (ps == 1 ? "token" : "page") +
                 " in its parent");
        if (node->lock_ref < 0) fail(name + " negative lock_ref");
        if (node->last_access > parent->last_access) fail(name + " accessed after its parent");
        int64_t child_locks = 0;
        for (const auto& kv : node->children) child_locks += kv.second->lock_ref;
        if (node->lock_ref < child_locks)
            fail(name + " lock_ref " + std::to_string(node->lock_ref) + " < its children's " +
                 std::to_string(child_locks));
        if (expect_unlocked && node->lock_ref) fail(name + " still locked");
        if (node->lock_ref) {
            protected_pages += static_cast<int64_t>(node->pages.size());
        } else {
            evictable += static_cast<int64_t>(node->pages.size());
            if (node->children.empty()) leaves.push_back(node);
        }
    }
    if (evictable != evictable_)
        fail("evictable " + std::to_string(evictable_) + " != recount " +
             std::to_string(evictable));
    if (protected_pages != protected_)
        fail("protected " + std::to_string(protected_) + " != recount " +
             std::to_string(protected_pages));

    std::vector<const Node*> live;
    for (const auto& entry : heap_) {
        if (!entry_is_live(entry)) continue;
        if (entry.time != entry.node->heap_time)
            fail(entry.node->repr() + " live heap entry not its newest");
        live.push_back(entry.node.get());
    }
    std::sort(live.begin(), live.end());
    if (std::adjacent_find(live.begin(), live.end()) != live.end())
        fail((*std::adjacent_find(live.begin(), live.end()))->repr() +
             " has two live heap entries");
    std::sort(leaves.begin(), leaves.end());
    if (live != leaves)
        fail("evictable-leaf heap holds " + std::to_string(live.size()) +
             " live nodes, tree has " + std::to_string(leaves.size()) + " unlocked leaves");
}

}  // namespace radix
