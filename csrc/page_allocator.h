// The KV page allocator in C++: the twin of radix_runtime/scheduler/allocator.py.
//
// The same LIFO free list (a fresh allocator hands out 1, 2, 3, ...; freed pages come back
// last-in first-out), the same checks in the same order with the same messages, all before any
// state changes. Page 0 is reserved (the padding page) and never handed out.
//
// It exists for speed: the radix tree's evictions free thousands of pages at a time, and the
// checks of the numpy allocator cost more than the C++ tree's whole eviction.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "radix_tree.h"  // IntegrityError

namespace radix {

class PageAllocator {
public:
    explicit PageAllocator(int64_t num_pages);

    int64_t num_pages() const { return num_pages_; }
    int64_t total_pages() const { return num_pages_ - 1; }
    int64_t free_pages() const { return top_; }

    // Writes `n` page ids to `out` and returns true, or returns false (taking nothing) when
    // fewer than `n` are free.
    bool alloc(int64_t n, int32_t* out);

    // Returns pages to the free list; throws std::invalid_argument (and frees nothing) on a
    // double free, the reserved page, an out-of-range id, or an id repeated within `pages`.
    template <typename T>
    void free(const T* pages, int64_t n);

    // Frees pages that come in pieces (the tree's eviction: one piece per evicted node) with
    // free()'s checks and all-or-nothing effect: stage() checks and marks each piece and writes
    // it past the free list's top, where nothing is free yet; finish() then frees them all, or,
    // if any piece was bad, unmarks everything and throws the error free(all pieces) would.
    class Staged final : public PageSink {
    public:
        explicit Staged(PageAllocator& a) : a_(a) {}
        void put(const int32_t* pages, int64_t n) override;
        void finish();

    private:
        PageAllocator& a_;
        int64_t staged_ = 0;
        std::vector<int64_t> failed_;  // every piece, from the first bad one on
        bool bad_ = false;
    };

    const int32_t* free_list() const { return stack_.data(); }  // free_pages() ids
    void check_integrity() const;

private:
    int64_t num_pages_;
    std::vector<int32_t> stack_;  // the free list; its top is at top_ - 1
    int64_t top_;
    std::vector<uint8_t> is_free_;

    // Throws the first error that allocator.py's free() checks find, in its order.
    [[noreturn]] void explain_bad_free(const std::vector<int64_t>& pages) const;
    // Checks `pages`, marks them free and writes them at stack_[top_ + offset ...]; on a bad
    // page undoes its own marks and returns false.
    template <typename T>
    bool stage(const T* pages, int64_t n, int64_t offset);
    void unstage(int64_t staged);
};

template <typename T>
bool PageAllocator::stage(const T* pages, int64_t n, int64_t offset) {
    // NOTE: n distinct pages that were all in use fit above the top: the stack has room.
    int32_t* dst = stack_.data() + top_ + offset;
    uint8_t* is_free = is_free_.data();
    const uint64_t allocatable = static_cast<uint64_t>(num_pages_ - 1);
    const auto out_of_range = [allocatable](int64_t p) {
        // p - 1 wraps around for p < 1: one compare checks both ends of 1..num_pages-1
        return static_cast<uint64_t>(p - 1) >= allocatable;
    };
    int64_t i = 0;
    // Four pages at a time (the loads are independent, so they overlap): a block that is in
    // range, in use and free of repeats is marked at once; any other block, and the tail, go
    // to the page-by-page loop below, which finds the exact bad page.
    for (; i + 4 <= n; i += 4) {
        const int64_t p0 = pages[i], p1 = pages[i + 1], p2 = pages[i + 2], p3 = pages[i + 3];
        if (out_of_range(p0) | out_of_range(p1) | out_of_range(p2) | out_of_range(p3)) break;
        if (is_free[p0] | is_free[p1] | is_free[p2] | is_free[p3]) break;
        if ((p0 == p1) | (p0 == p2) | (p0 == p3) | (p1 == p2) | (p1 == p3) | (p2 == p3)) break;
        is_free[p0] = is_free[p1] = is_free[p2] = is_free[p3] = 1;
        dst[i] = static_cast<int32_t>(p0);
        dst[i + 1] = static_cast<int32_t>(p1);
        dst[i + 2] = static_cast<int32_t>(p2);
        dst[i + 3] = static_cast<int32_t>(p3);
    }
    for (; i < n; ++i) {
        const int64_t p = static_cast<int64_t>(pages[i]);
        // A page repeated within the call is "already free" at its second occurrence.
        if (out_of_range(p) || is_free[p]) break;
        is_free[p] = 1;
        dst[i] = static_cast<int32_t>(p);
    }
    if (i == n) return true;
    for (int64_t j = 0; j < i; ++j) is_free[dst[j]] = 0;
    return false;
}

template <typename T>
void PageAllocator::free(const T* pages, int64_t n) {
    if (stage(pages, n, 0)) {
        top_ += n;
        return;
    }
    explain_bad_free(std::vector<int64_t>(pages, pages + n));
}

}  // namespace radix
