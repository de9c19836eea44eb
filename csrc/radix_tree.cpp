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
    const std::string host =
        on_host ? ", host_pages=" + std::to_string(host_pages.size()) : std::string();
    return "TreeNode(id=" + std::to_string(id) + ", tokens=" + std::to_string(key_len_) +
           ", pages=" + std::to_string(num_pages_) + host +
           ", lock_ref=" + std::to_string(lock_ref) +
           ", last_access=" + std::to_string(last_access) + ")";
}

// ------------------------------------------------------------------------------- the tree

Tree::Tree(int32_t page_size, PagePool* host, bool write_through)
    : page_size_(page_size), host_(host), write_through_(write_through && host != nullptr) {
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
    host_heap_.clear();
    host_heap_limit_ = 1024;
    copy_heap_.clear();
    copy_heap_limit_ = 1024;
    host_cached_ = host_evictable_ = 0;
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
    host_heap_.clear();
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
    ++root->dev_children;
    ++num_nodes_;
    return raw;
}

void Tree::tick_root() { root_->last_access = ++clock_; }

Match Tree::match_prefix(const int32_t* tokens, int64_t n, std::vector<Node*>& path,
                         const std::string* ns) {
    path.clear();
    Node* start = namespace_node(ns, false);
    if (!start) {
        tick_root();
        return {root_.get(), 0, nullptr, 0};
    }
    int64_t length = 0;
    Node* node = walk(start, tokens, n / page_size_, &path, length);
    push_if_evictable_leaf(node);
    if (!host_ || node->on_device()) return {node, length, node, 0};
    // the match ends on the host: the device run is the path's nodes that hold pages
    push_host_leaf(node);
    Node* dev = node;
    while (!dev->on_device()) dev = dev->parent;
    push_if_evictable_leaf(dev);
    int64_t dev_len = 0;
    for (const Node* p : path) dev_len += p->num_pages();
    dev_len *= page_size_;
    return {dev, dev_len, node, length - dev_len};
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
    int64_t walked = 0;
    Node* node = walk(start, tokens, want, nullptr, walked);
    prefix_len = walked;
    if (!node->on_device()) {
        // the walk ran on into host-only nodes: they take the caller's pages (its KV is the
        // same) and count as new, so the caller keeps them instead of freeing duplicates
        prefix_len = walked - to_device(node, pages, walked / ps, false, false);
    }
    if (walked < want * ps) {
        NodePtr leaf = new_node();
        leaf->set_edge(tokens + walked, want * ps - walked, pages + walked / ps,
                       want - walked / ps);
        leaf->parent = node;
        leaf->last_access = clock_;
        leaf->order = node->next_child_order++;
        Node* raw = leaf.get();
        node->children.add(hash_of(raw->key()), std::move(leaf));
        ++node->dev_children;
        ++num_nodes_;
        evictable_ += raw->num_pages();
        node = raw;
        if (write_through_ && write_to_host(raw)) push_copy(raw);
    }
    push_if_evictable_leaf(node);
    return node;
}

// ---------------------------------------------------------------------------- the host tier

std::vector<Node*> Tree::host_only_path(Node* node) const {
    std::vector<Node*> path;
    for (; !node->on_device(); node = node->parent) path.push_back(node);
    std::reverse(path.begin(), path.end());
    return path;
}

int64_t Tree::load_back(Node* node, const int32_t* pages, int64_t num_pages) {
    if (node->lock_ref <= 0)
        throw std::runtime_error("load_back of an unlocked node " + node->repr());
    int64_t want = 0;
    for (const Node* n : host_only_path(node)) want += static_cast<int64_t>(n->host_pages.size());
    if (num_pages != want)
        throw std::invalid_argument("the host-only path to " + node->repr() + " needs " +
                                    std::to_string(want) + " pages, got " +
                                    std::to_string(num_pages));
    return to_device(node, pages, num_pages, true, true);
}

int64_t Tree::to_device(Node* node, const int32_t* pages, int64_t num_pages, bool copy,
                        bool tail) {
    const std::vector<Node*> path = host_only_path(node);
    int64_t total = 0;
    for (const Node* n : path) total += static_cast<int64_t>(n->host_pages.size());
    int64_t off = tail ? 0 : num_pages - total;
    for (Node* n : path) {
        const int64_t k = static_cast<int64_t>(n->host_pages.size());
        n->set_pages(pages + off, k);
        off += k;
        ++n->parent->dev_children;
        if (n->lock_ref) {
            protected_ += k;
        } else {
            evictable_ += k;
            host_evictable_ -= k;
        }
        if (copy) {
            loads_.push_back({n->host_pages, std::vector<int32_t>(n->pages(), n->pages() + k)});
            n->load_pending = true;  // its host copy stays until the load is taken
            loading_.push_back(n->shared_from_this());
        } else {
            push_copy(n);
        }
        tier_event(TierEvent::kLoaded, n->host_pages.data(), k, n->pages());
    }
    for (Node* n : path) push_if_evictable_leaf(n);
    return total * page_size_;
}

bool Tree::write_to_host(Node* node) {
    if (node->on_host) return true;
    const int64_t n = node->num_pages();
    if (host_->free_pages() < n) evict_host(n - host_->free_pages());
    std::vector<int32_t> got;
    if (!host_->alloc(n, got)) return false;
    node->host_pages = std::move(got);
    node->on_host = true;
    host_cached_ += n;
    writes_.push_back({std::vector<int32_t>(node->pages(), node->pages() + n), node->host_pages});
    return true;
}

void Tree::take_copies(std::vector<Copy>& writes, std::vector<Copy>& loads, bool& writes_block) {
    writes_block = writes_block_ && !writes_.empty();
    writes = std::move(writes_);
    loads = std::move(loads_);
    writes_.clear();
    loads_.clear();
    writes_block_ = false;
    std::vector<NodePtr> loading = std::move(loading_);
    loading_.clear();
    for (const NodePtr& n : loading) {
        n->load_pending = false;
        push_copy(n.get());
    }
}

void Tree::push_copy(Node* node) {
    if (node->in_copy_heap || !node->on_host || node->num_pages() == 0 || !node->parent) return;
    node->in_copy_heap = true;
    copy_heap_.push_back({node->last_access, node->id, node->shared_from_this()});
    std::push_heap(copy_heap_.begin(), copy_heap_.end(), Later{});
    if (copy_heap_.size() > copy_heap_limit_) {
        std::vector<HeapEntry> live;
        for (auto& entry : copy_heap_) {
            Node* n = entry.node.get();
            if (n->parent && n->on_host && n->num_pages())
                live.push_back(std::move(entry));
            else
                n->in_copy_heap = false;
        }
        std::make_heap(live.begin(), live.end(), Later{});
        copy_heap_ = std::move(live);
        copy_heap_limit_ = std::max<size_t>(1024, 2 * copy_heap_.size());
    }
}

void Tree::tier_event(TierEvent::Kind kind, const int32_t* src, int64_t n, const int32_t* dst) {
    if (!record_tier_) return;
    tier_events_.push_back({kind, std::vector<int32_t>(src, src + n),
                            dst ? std::vector<int32_t>(dst, dst + n) : std::vector<int32_t>()});
}

void Tree::push_host_leaf(Node* node) {
    if (!node->children.empty() || node->lock_ref || node->on_device() || !node->parent) return;
    if (node->host_heap_time == node->last_access) return;
    node->host_heap_time = node->last_access;
    host_heap_.push_back({node->last_access, node->id, node->shared_from_this()});
    std::push_heap(host_heap_.begin(), host_heap_.end(), Later{});
    if (host_heap_.size() > host_heap_limit_) {
        std::vector<HeapEntry> live;
        for (auto& entry : host_heap_) {
            if (host_entry_is_live(entry))
                live.push_back(std::move(entry));
            else if (entry.time == entry.node->host_heap_time)
                entry.node->host_heap_time = -1;
        }
        std::make_heap(live.begin(), live.end(), Later{});
        host_heap_ = std::move(live);
        host_heap_limit_ = std::max<size_t>(1024, 2 * host_heap_.size());
    }
}

bool Tree::host_entry_is_live(const HeapEntry& e) {
    const Node* node = e.node.get();
    return e.time == node->last_access && node->lock_ref == 0 && node->children.empty() &&
           node->parent != nullptr && !node->on_device();
}

int64_t Tree::evict_host(int64_t num_pages) {
    int64_t freed = 0;
    // first the host copies of nodes also on the device (their KV stays there)
    std::vector<int32_t> copies;
    while (freed < num_pages && !copy_heap_.empty()) {
        std::pop_heap(copy_heap_.begin(), copy_heap_.end(), Later{});
        HeapEntry entry = std::move(copy_heap_.back());
        copy_heap_.pop_back();
        Node* node = entry.node.get();
        node->in_copy_heap = false;
        if (!node->parent || !node->on_host || node->num_pages() == 0) continue;
        if (node->lock_ref || node->load_pending) continue;  // filed again by unlock / take
        if (entry.time != node->last_access) {  // used since: its place is further down
            node->in_copy_heap = true;
            entry.time = node->last_access;
            copy_heap_.push_back(std::move(entry));
            std::push_heap(copy_heap_.begin(), copy_heap_.end(), Later{});
            continue;
        }
        const int64_t k = static_cast<int64_t>(node->host_pages.size());
        host_cached_ -= k;
        freed += k;
        copies.insert(copies.end(), node->host_pages.begin(), node->host_pages.end());
        node->host_pages.clear();
        node->on_host = false;
    }
    if (!copies.empty()) host_->free(copies.data(), static_cast<int64_t>(copies.size()));
    std::vector<int32_t> released;
    while (freed < num_pages && !host_heap_.empty()) {
        std::pop_heap(host_heap_.begin(), host_heap_.end(), Later{});
        HeapEntry entry = std::move(host_heap_.back());
        host_heap_.pop_back();
        Node* node = entry.node.get();
        if (entry.time == node->host_heap_time) node->host_heap_time = -1;
        if (!host_entry_is_live(entry)) continue;
        Node* parent = node->parent;
        unlink(node);  // `entry` keeps the node alive
        node->parent = nullptr;
        --num_nodes_;
        const int64_t k = static_cast<int64_t>(node->host_pages.size());
        host_evictable_ -= k;
        host_cached_ -= k;
        freed += k;
        released.insert(released.end(), node->host_pages.begin(), node->host_pages.end());
        push_host_leaf(parent);
        push_if_evictable_leaf(parent);  // a namespace node may now be empty
    }
    if (!released.empty()) {
        host_->free(released.data(), static_cast<int64_t>(released.size()));
        tier_event(TierEvent::kEvictedHost, released.data(),
                   static_cast<int64_t>(released.size()), nullptr);
    }
    return freed;
}

void Tree::remove(Node* node) {
    Node* parent = node->parent;
    NodePtr keep = node->shared_from_this();
    unlink(node);
    node->parent = nullptr;
    --parent->dev_children;
    --num_nodes_;
    std::vector<int32_t> host;
    if (node->on_host) {
        host_cached_ -= static_cast<int64_t>(node->host_pages.size());
        host.insert(host.end(), node->host_pages.begin(), node->host_pages.end());
    }
    // NOTE: the subtree's nodes are detached one by one (no recursive destruction)
    std::vector<NodePtr> subtree;
    std::vector<Node*> stack = node->ordered_children();
    while (!stack.empty()) {
        Node* n = stack.back();
        stack.pop_back();
        for (Node* c : n->ordered_children()) stack.push_back(c);
        subtree.push_back(n->shared_from_this());
        n->parent = nullptr;
        --num_nodes_;
        const int64_t k = static_cast<int64_t>(n->host_pages.size());
        host_cached_ -= k;
        host_evictable_ -= k;
        host.insert(host.end(), n->host_pages.begin(), n->host_pages.end());
    }
    node->children.clear();
    for (auto& n : subtree) n->children.clear();
    if (!host.empty()) {
        host_->free(host.data(), static_cast<int64_t>(host.size()));
        tier_event(TierEvent::kEvictedHost, host.data(), static_cast<int64_t>(host.size()),
                   nullptr);
    }
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

    const bool on_device = child->on_device();
    const int64_t cut = at / ps;  // pages of the upper part
    NodePtr upper = new_node();
    upper->set_edge(child->key(), at, child->pages(), on_device ? cut : 0);
    upper->parent = parent;
    upper->lock_ref = child->lock_ref;
    upper->last_access = child->last_access;
    upper->order = child->order;  // the upper part takes the child's place among its siblings
    upper->dev_children = on_device ? 1 : 0;
    if (child->on_host) {
        upper->on_host = true;
        upper->host_pages.assign(child->host_pages.begin(), child->host_pages.begin() + cut);
        child->host_pages.erase(child->host_pages.begin(), child->host_pages.begin() + cut);
        upper->load_pending = child->load_pending;
        if (upper->load_pending) loading_.push_back(upper);
    }

    // The lower part keeps its identity (handles, lock counts and heap entries stay valid).
    child->drop_front(at, on_device ? cut : 0);
    child->parent = upper.get();
    child->order = upper->next_child_order++;
    upper->children.add(hash_of(child->key()), std::move(lower));

    Node* raw = upper.get();
    parent->children.add(hash, std::move(upper));
    ++num_nodes_;
    if (raw->on_host) push_copy(raw);
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
            if (!size && node->on_host) host_evictable_ -= static_cast<int64_t>(node->host_pages.size());
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
            if (node->on_host) {
                if (size)
                    push_copy(node);  // its host copy may be dropped again
                else
                    host_evictable_ += static_cast<int64_t>(node->host_pages.size());
            }
        }
    }
    push_if_evictable_leaf(start);  // only the start can be a leaf
    if (start->on_host) {
        push_host_leaf(start);
        Node* dev = start;
        while (!dev->on_device()) dev = dev->parent;  // the device run's last node
        push_if_evictable_leaf(dev);
    }
}

// ------------------------------------------------------------------------------- eviction

void Tree::unlink(Node* node) {
    Node* parent = node->parent;
    if (node->is_namespace())
        parent->namespaces->erase(*node->ns);
    else
        parent->children.take(node);
}

// An unlocked *device leaf*: on the device, none of its children on the device (one tier: a leaf).
void Tree::push_if_evictable_leaf(Node* node) {
    if (node->dev_children || node->lock_ref || node == root_.get() || !node->on_device()) return;
    // a namespace node goes when its last (host-only) child has gone
    if (node->is_namespace() && !node->children.empty()) return;
    if (node->heap_time == node->last_access) return;  // its live entry is already in the heap
    node->heap_time = node->last_access;
    heap_.push_back({node->last_access, node->id, node->shared_from_this()});
    std::push_heap(heap_.begin(), heap_.end(), Later{});
    if (heap_.size() > heap_limit_) compact_heap();
}

bool Tree::entry_is_live(const HeapEntry& e) {
    const Node* node = e.node.get();
    return e.time == node->last_access && node->lock_ref == 0 && node->dev_children == 0 &&
           node->parent != nullptr && node->on_device() &&
           !(node->is_namespace() && !node->children.empty());
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

int64_t Tree::evict(int64_t num_pages, std::vector<int32_t>& freed_pages,
                    std::vector<int32_t>* dropped, bool* any_dropped) {
    struct Append final : PageSink {
        std::vector<int32_t>& out;
        std::vector<int32_t>* dropped;
        bool any = false;
        Append(std::vector<int32_t>& o, std::vector<int32_t>* d) : out(o), dropped(d) {}
        void put(const int32_t* pages, int64_t n) override {
            out.insert(out.end(), pages, pages + n);
        }
        void put_dropped(const int32_t* pages, int64_t n) override {
            any = true;
            put(pages, n);
            if (dropped) dropped->insert(dropped->end(), pages, pages + n);
        }
    } append(freed_pages, dropped);
    const int64_t freed = evict(num_pages, append);
    if (any_dropped) *any_dropped = append.any;
    return freed;
}

int64_t Tree::evict(int64_t num_pages, PageSink& sink) {
    int64_t freed = 0;
    std::vector<int32_t> offloaded;  // device pages of nodes kept on the host
    std::vector<NodePtr> dropped;    // nodes that left the tree
    while (freed < num_pages && !heap_.empty()) {
        std::pop_heap(heap_.begin(), heap_.end(), Later{});
        HeapEntry entry = std::move(heap_.back());
        heap_.pop_back();
        Node* node = entry.node.get();
        if (entry.time == node->heap_time) node->heap_time = -1;
        if (!entry_is_live(entry)) continue;
        Node* parent = node->parent;
        const int64_t size = node->num_pages();
        evictable_ -= size;
        freed += size;
        if (host_ && !node->is_namespace() && write_to_host(node)) {
            offloaded.insert(offloaded.end(), node->pages(), node->pages() + size);
            tier_event(TierEvent::kOffloaded, node->pages(), size, node->host_pages.data());
            node->set_pages(nullptr, 0);
            --parent->dev_children;
            host_evictable_ += static_cast<int64_t>(node->host_pages.size());
            push_host_leaf(node);
        } else {
            dropped.push_back(std::move(entry.node));  // keeps the node (and its pages) alive
            remove(node);
        }
        push_if_evictable_leaf(parent);
    }
    if (!offloaded.empty() || !dropped.empty()) writes_block_ = true;
    if (!offloaded.empty()) sink.put(offloaded.data(), static_cast<int64_t>(offloaded.size()));
    for (const NodePtr& node : dropped) sink.put_dropped(node->pages(), node->num_pages());
    return freed;
}

void Tree::reset(std::vector<int32_t>& released) {
    bool locked = protected_ != 0;
    for (Node* child : root_->ordered_children()) locked = locked || child->lock_ref != 0;
    if (locked) throw std::runtime_error("reset of the radix cache while nodes are locked");
    std::vector<int32_t> host;
    for (Node* node : nodes()) {
        released.insert(released.end(), node->pages(), node->pages() + node->num_pages());
        if (node->on_host) host.insert(host.end(), node->host_pages.begin(), node->host_pages.end());
    }
    dismantle();
    new_tree();
    if (!host.empty()) host_->free(host.data(), static_cast<int64_t>(host.size()));
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
    int64_t root_dev = 0;
    for (const Node* child : root->ordered_children()) root_dev += child->on_device();
    if (root->dev_children != root_dev) fail("root dev_children");
    int64_t evictable = 0, protected_pages = 0, host_evictable = 0, host_cached = 0;
    std::vector<const Node*> leaves, host_leaves;
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
        const bool on_device = node->on_device();
        if (node->on_host) {
            if (!host_) fail(name + " on the host without a host tier");
            const int64_t k = static_cast<int64_t>(node->host_pages.size());
            if (k != key_len / ps) fail(name + " host pages mismatch");
            host_cached += k;
            if (!on_device && node->lock_ref == 0) host_evictable += k;
        } else if (!on_device) {
            fail(name + " is in neither tier");
        }
        if (on_device) {
            if (node->num_pages() != key_len / ps) fail(name + " pages/key length mismatch");
            if (!parent->on_device()) fail(name + " is on the device, its parent is not");
        }
        int64_t dev_children = 0;
        node->children.for_each([&](Node* child) { dev_children += child->on_device(); });
        if (node->dev_children != dev_children)
            fail(name + " dev_children != " + std::to_string(dev_children));
        if (!on_device && node->lock_ref == 0 && node->children.empty()) host_leaves.push_back(node);
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
            if (on_device && node->dev_children == 0 &&
                (!node->is_namespace() || node->children.empty()))
                leaves.push_back(node);
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

    if (!host_) return;
    std::vector<const Node*> host_live;
    for (const auto& entry : host_heap_)
        if (host_entry_is_live(entry)) host_live.push_back(entry.node.get());
    std::sort(host_live.begin(), host_live.end());
    host_live.erase(std::unique(host_live.begin(), host_live.end()), host_live.end());
    std::sort(host_leaves.begin(), host_leaves.end());
    if (host_live != host_leaves)
        fail("host heap holds " + std::to_string(host_live.size()) + " live nodes, tree has " +
             std::to_string(host_leaves.size()) + " host leaves");
    if (host_cached != host_cached_)
        fail("host cached " + std::to_string(host_cached_) + " != " + std::to_string(host_cached));
    if (host_evictable != host_evictable_)
        fail("host evictable " + std::to_string(host_evictable_) + " != recount " +
             std::to_string(host_evictable));

    // every unlocked node on both tiers without a queued load has one host-copy heap entry
    std::vector<const Node*> entries;
    for (const auto& entry : copy_heap_) {
        if (!entry.node->in_copy_heap)
            fail(entry.node->repr() + " in the host-copy heap without its flag");
        entries.push_back(entry.node.get());
    }
    std::sort(entries.begin(), entries.end());
    if (std::adjacent_find(entries.begin(), entries.end()) != entries.end())
        fail("a node has two host-copy heap entries");
    std::vector<const Node*> loading;
    for (const NodePtr& n : loading_) loading.push_back(n.get());
    std::sort(loading.begin(), loading.end());
    for (const Node* node : all) {
        if (node->load_pending && !std::binary_search(loading.begin(), loading.end(), node))
            fail(node->repr() + " waits for a load that is not queued");
        if (node->in_copy_heap) {
            if (!std::binary_search(entries.begin(), entries.end(), node))
                fail(node->repr() + " flagged but not in the host-copy heap");
        } else if (node->on_host && node->num_pages() && !node->lock_ref && !node->load_pending) {
            fail(node->repr() + " is on both tiers, not in the host-copy heap");
        }
    }
}

}  // namespace radix
