// The radix tree of KV-cache pages; see radix_tree.h and radix_runtime/scheduler/radix_cache.py
// (the reference: every function here has a same-named twin there).
#include "radix_tree.h"

#include <algorithm>
#include <cstring>

namespace radix {

namespace {

void fail(const std::string& message) { throw IntegrityError(message); }

}  // namespace

uint64_t hash_page(const int32_t* tokens, int32_t page_size) noexcept {
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (int32_t i = 0; i < page_size; ++i) {
        h ^= static_cast<uint32_t>(tokens[i]);
        h *= 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    return h;
}

// -------------------------------------------------------------------------------- children

Node* Children::find(const int32_t* first, uint64_t hash, int32_t page_size) const {
    const size_t bytes = sizeof(int32_t) * page_size;
    if (!map_) {
        for (const Entry& e : small_)
            if (e.hash == hash && std::memcmp(e.node->key(), first, bytes) == 0)
                return e.node.get();
        return nullptr;
    }
    auto [lo, hi] = map_->equal_range(hash);
    for (; lo != hi; ++lo)
        if (std::memcmp(lo->second->key(), first, bytes) == 0) return lo->second.get();
    return nullptr;
}

void Children::add(uint64_t hash, NodePtr child) {
    child->first_hash = hash;
    if (!map_ && small_.size() < kSmall) {
        small_.push_back({hash, std::move(child)});
        return;
    }
    if (!map_) {
        map_ = std::make_unique<std::unordered_multimap<uint64_t, NodePtr>>();
        for (Entry& e : small_) map_->emplace(e.hash, std::move(e.node));
        small_.clear();
        small_.shrink_to_fit();
    }
    map_->emplace(hash, std::move(child));
}

NodePtr Children::take(const Node* child) {
    NodePtr out;
    if (!map_) {
        for (size_t i = 0; i < small_.size(); ++i) {
            if (small_[i].node.get() != child) continue;
            out = std::move(small_[i].node);
            small_.erase(small_.begin() + static_cast<std::ptrdiff_t>(i));
            return out;
        }
        return out;
    }
    auto [lo, hi] = map_->equal_range(child->first_hash);
    for (; lo != hi; ++lo) {
        if (lo->second.get() != child) continue;
        out = std::move(lo->second);
        map_->erase(lo);
        return out;
    }
    return out;
}

// ------------------------------------------------------------------------------------ nodes

Node::Node(int32_t page_size_, int64_t id_) : id(id_), page_size(page_size_) {}

Node::~Node() { std::free(block_); }

void Node::set_edge(const int32_t* key, int64_t key_len, const int32_t* pages,
                    int64_t num_pages) {
    const size_t n = static_cast<size_t>(key_len + num_pages);
    auto* block = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * (n ? n : 1)));
    if (!block) throw std::bad_alloc();
    if (key_len) std::memcpy(block, key, sizeof(int32_t) * key_len);
    if (num_pages) std::memcpy(block + key_len, pages, sizeof(int32_t) * num_pages);
    std::free(block_);
    block_ = block;
    key_len_ = key_len;
    num_pages_ = num_pages;
}

void Node::set_pages(const int32_t* pages, int64_t num_pages) {
    std::vector<int32_t> key(block_, block_ + key_len_);
    set_edge(key.data(), key_len_, pages, num_pages);
}

void Node::drop_front(int64_t tokens, int64_t pages) {
    // Both moves go to lower addresses, so they never overwrite what is still to be moved.
    std::memmove(block_, block_ + tokens, sizeof(int32_t) * (key_len_ - tokens));
    std::memmove(block_ + key_len_ - tokens, block_ + key_len_ + pages,
                 sizeof(int32_t) * (num_pages_ - pages));
    key_len_ -= tokens;
    num_pages_ -= pages;
}

std::vector<Node*> Node::ordered_children() const {
    std::vector<Node*> out;
    out.reserve(children.size());
    children.for_each([&](Node* child) { out.push_back(child); });
    if (namespaces)
        for (const auto& kv : *namespaces) out.push_back(kv.second.get());
    std::sort(out.begin(), out.end(), [](Node* a, Node* b) { return a->order < b->order; });
    return out;
}

std::string Node::repr() const {
    if (ns)
        return "TreeNode(id=" + std::to_string(id) + ", namespace='" + *ns +
               "', lock_ref=" + std::to_string(lock_ref) +
               ", last_access=" + std::to_string(last_access) + ")";
    return "TreeNode(id=" + std::to_string(id) + ", tokens=" + std::to_string(key_len_) +
           ", pages=" + std::to_string(num_pages_) + ", lock_ref=" + std::to_string(lock_ref) +
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
        for (Node* child : node->ordered_children()) {
            stack.push_back(child);
            all.push_back(child->shared_from_this());
        }
    }
    for (auto& node : all) {
        node->parent = nullptr;
        node->children.clear();
    }
    root_->children.clear();
    root_->namespaces.reset();
    heap_.clear();
}

// ------------------------------------------------------------------------- match / insert

Node* Tree::namespace_node(const std::string* ns, bool create) {
    Node* root = root_.get();
    if (!ns) return root;
    if (root->namespaces) {
        auto it = root->namespaces->find(*ns);
        if (it != root->namespaces->end()) return it->second.get();
    }
    if (!create) return nullptr;
    if (!root->namespaces) root->namespaces = std::make_unique<std::map<std::string, NodePtr>>();
    NodePtr node = new_node();
    node->set_edge(nullptr, 0, nullptr, 0);
    node->ns = std::make_unique<std::string>(*ns);
    node->parent = root;
    node->order = root->next_child_order++;
    Node* raw = node.get();
    (*root->namespaces)[*ns] = std::move(node);
    ++num_nodes_;
    return raw;
}

void Tree::tick_root() { root_->last_access = ++clock_; }

Node* Tree::match_prefix(const int32_t* tokens, int64_t n, std::vector<Node*>& path,
                         int64_t& length, const std::string* ns) {
    path.clear();
    Node* start = namespace_node(ns, false);
    if (!start) {
        tick_root();
        length = 0;
        return root_.get();
    }
    Node* node = walk(start, tokens, n / page_size_, &path, length);
    push_if_evictable_leaf(node);
    return node;
}

Node* Tree::insert(const int32_t* tokens, int64_t n, const int32_t* pages, int64_t num_pages,
                   int64_t& prefix_len, const std::string* ns) {
    const int64_t ps = page_size_;
    const int64_t want = n / ps;
    if (num_pages != want)
        throw std::invalid_argument(std::to_string(n) + " tokens need " + std::to_string(want) +
                                    " pages, got " + std::to_string(num_pages));
    // NOTE: an empty insert does not make a namespace node (it would hold nothing)
    Node* start = namespace_node(ns, want > 0);
    if (!start) {
        tick_root();
        prefix_len = 0;
        return root_.get();
    }
    Node* node = walk(start, tokens, want, nullptr, prefix_len);
    if (prefix_len < want * ps) {
        NodePtr leaf = new_node();
        leaf->set_edge(tokens + prefix_len, want * ps - prefix_len, pages + prefix_len / ps,
                       want - prefix_len / ps);
        leaf->parent = node;
        leaf->last_access = clock_;
        leaf->order = node->next_child_order++;
        Node* raw = leaf.get();
        node->children.add(hash_of(raw->key()), std::move(leaf));
        ++num_nodes_;
        evictable_ += raw->num_pages();
        node = raw;
    }
    push_if_evictable_leaf(node);
    return node;
}

Node* Tree::walk(Node* start, const int32_t* tokens, int64_t num_pages,
                 std::vector<Node*>* path, int64_t& length) {
    const int64_t ps = page_size_;
    const int64_t now = ++clock_;
    root_->last_access = now;
    Node* node = start;
    node->last_access = now;
    const int64_t end = num_pages * ps;
    int64_t off = 0;
    while (off < end) {
        Node* child = node->children.find(tokens + off, hash_of(tokens + off), page_size_);
        if (!child) break;
        const int32_t* key = child->key();
        const int64_t key_len = child->key_len();
        const int64_t m = std::min(key_len, end - off);
        int64_t matched;
        if (std::memcmp(key, tokens + off, sizeof(int32_t) * m) == 0) {
            matched = m;  // the common case: the whole edge (or the whole rest of the query)
        } else {
            // The child key guarantees that the first page matches, so `first` >= page_size.
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
    const uint64_t hash = child->first_hash;  // the upper part's first page too
    NodePtr lower = parent->children.take(child);

    NodePtr upper = new_node();
    upper->set_edge(child->key(), at, child->pages(), at / ps);
    upper->parent = parent;
    upper->lock_ref = child->lock_ref;
    upper->last_access = child->last_access;
    upper->order = child->order;  // the upper part takes the child's place among its siblings

    // The lower part keeps its identity (handles, lock counts and heap entries stay valid).
    child->drop_front(at, at / ps);
    child->parent = upper.get();
    child->order = upper->next_child_order++;
    upper->children.add(hash_of(child->key()), std::move(lower));

    Node* raw = upper.get();
    parent->children.add(hash, std::move(upper));
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
            const int64_t size = node->num_pages();
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
            const int64_t size = node->num_pages();
            protected_ -= size;
            evictable_ += size;
        }
    }
    push_if_evictable_leaf(start);  // only the start can be a leaf
}

// ------------------------------------------------------------------------------- eviction

void Tree::unlink(Node* node) {
    Node* parent = node->parent;
    if (node->is_namespace())
        parent->namespaces->erase(*node->ns);
    else
        parent->children.take(node);
}

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
    struct Append final : PageSink {
        std::vector<int32_t>& out;
        explicit Append(std::vector<int32_t>& o) : out(o) {}
        void put(const int32_t* pages, int64_t n) override {
            out.insert(out.end(), pages, pages + n);
        }
    } append(released);
    return evict(num_pages, append);
}

int64_t Tree::evict(int64_t num_pages, PageSink& sink) {
    int64_t freed = 0;
    while (freed < num_pages && !heap_.empty()) {
        std::pop_heap(heap_.begin(), heap_.end(), Later{});
        HeapEntry entry = std::move(heap_.back());
        heap_.pop_back();
        Node* node = entry.node.get();
        if (entry.time == node->heap_time) node->heap_time = -1;
        if (!entry_is_live(entry)) continue;
        Node* parent = node->parent;
        unlink(node);  // `entry` keeps the node alive
        node->parent = nullptr;
        --num_nodes_;
        const int64_t size = node->num_pages();
        evictable_ -= size;
        freed += size;
        sink.put(node->pages(), size);
        push_if_evictable_leaf(parent);
    }
    return freed;
}

void Tree::reset(std::vector<int32_t>& released) {
    bool locked = protected_ != 0;
    for (Node* child : root_->ordered_children()) locked = locked || child->lock_ref != 0;
    if (locked) throw std::runtime_error("reset of the radix cache while nodes are locked");
    for (Node* node : nodes())
        released.insert(released.end(), node->pages(), node->pages() + node->num_pages());
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
    if (root->parent || root->key_len() || root->num_pages()) fail("bad root");
    if (root->lock_ref != 0) fail("root lock_ref " + std::to_string(root->lock_ref) + " != 0");
    const std::vector<Node*> all = nodes();
    if (static_cast<int64_t>(all.size()) != num_nodes_)
        fail("node count " + std::to_string(num_nodes_) + " != " + std::to_string(all.size()));
    int64_t evictable = 0, protected_pages = 0;
    std::vector<const Node*> leaves;
    for (const Node* node : all) {
        const Node* parent = node->parent;
        const std::string name = node->repr();
        const int64_t key_len = node->key_len();
        if (!parent) fail(name + " in the tree has no parent");
        if (node->is_namespace()) {
            if (parent != root) fail("namespace node " + name + " is not a child of the root");
            if (key_len || node->num_pages()) fail(name + " holds tokens");
            bool filed = false;
            if (root->namespaces) {
                auto it = root->namespaces->find(*node->ns);
                filed = it != root->namespaces->end() && it->second.get() == node;
            }
            if (!filed) fail(name + " not under its name");
        } else {
            if (key_len == 0) fail("empty non-root node " + name);
            if (node->first_hash != hash_of(node->key()) ||
                parent->children.find(node->key(), node->first_hash, page_size_) != node)
                fail(name + " is not under its first " + (ps == 1 ? "token" : "page") +
                     " in its parent");
        }
        if (key_len % ps) fail(name + " key is not page-aligned");
        if (node->num_pages() != key_len / ps) fail(name + " pages/key length mismatch");
        if (node->lock_ref < 0) fail(name + " negative lock_ref");
        if (node->last_access > parent->last_access) fail(name + " accessed after its parent");
        int64_t child_locks = 0;
        node->children.for_each([&](Node* child) { child_locks += child->lock_ref; });
        if (node->lock_ref < child_locks)
            fail(name + " lock_ref " + std::to_string(node->lock_ref) + " < its children's " +
                 std::to_string(child_locks));
        if (expect_unlocked && node->lock_ref) fail(name + " still locked");
        if (node->lock_ref) {
            protected_pages += node->num_pages();
        } else {
            evictable += node->num_pages();
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
