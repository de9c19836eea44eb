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

    const int32_t* free_list() const { return stack_.data(); }  // free_pages() ids
    void check_integrity() const;

private:
    int64_t num_pages_;
    std::vector<int32_t> stack_;  // the free list; its top is at top_ - 1
    int64_t top_;
    std::vector<uint8_t> is_free_;

    // Throws the first error that allocator.py's free() checks find, in its order.
    [[noreturn]] void explain_bad_free(const std::vector<int64_t>& pages) const;
};

template <typename T>
void PageAllocator::free(const T* pages, int64_t n) {
    // One pass marks the pages free, checking as it goes (a page repeated within `pages` is
    // "already free" at its second occurrence). On any problem the marks are undone and
    // explain_bad_free() raises the error that the numpy allocator would.
    int64_t i = 0;
    for (; i < n; ++i) {
        const int64_t p = static_cast<int64_t>(pages[i]);
        if (p < 1 || p >= num_pages_ || is_free_[p]) break;
        is_free_[p] = 1;
    }
    if (i < n) {
        for (int64_t j = 0; j < i; ++j) is_free_[pages[j]] = 0;
        std::vector<int64_t> ids(pages, pages + n);
        explain_bad_free(ids);
    }
    // NOTE: n distinct pages that were all in use, so the stack has room for them.
    for (int64_t j = 0; j < n; ++j) stack_[top_ + j] = static_cast<int32_t>(pages[j]);
    top_ += n;
}

}  // namespace radix
