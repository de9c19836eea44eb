// The KV page allocator; see page_allocator.h and radix_runtime/scheduler/allocator.py.
#include "page_allocator.h"

#include <algorithm>
#include <unordered_map>

namespace radix {

PageAllocator::PageAllocator(int64_t num_pages) : num_pages_(num_pages) {
    if (num_pages < 2)
        throw std::invalid_argument("num_pages must be >= 2 (page 0 is reserved), got " +
                                    std::to_string(num_pages));
    if (num_pages > INT32_MAX) throw std::invalid_argument("num_pages must fit in int32");
    // Stack with its top at the end, so that a fresh allocator hands out 1, 2, 3, ...
    stack_.resize(num_pages - 1);
    for (int64_t i = 0; i < num_pages - 1; ++i) stack_[i] = static_cast<int32_t>(num_pages - 1 - i);
    top_ = num_pages - 1;
    is_free_.assign(num_pages, 1);
    is_free_[0] = 0;
}

bool PageAllocator::alloc(int64_t n, int32_t* out) {
    if (n < 0) throw std::invalid_argument("cannot allocate " + std::to_string(n) + " pages");
    if (n > top_) return false;
    for (int64_t i = 0; i < n; ++i) {
        out[i] = stack_[top_ - 1 - i];
        is_free_[out[i]] = 0;
    }
    top_ -= n;
    return true;
}

void PageAllocator::explain_bad_free(const std::vector<int64_t>& pages) const {
    const auto [lo, hi] = std::minmax_element(pages.begin(), pages.end());
    if (*lo < 1 || *hi >= num_pages_) {
        const int64_t bad = *lo < 1 ? *lo : *hi;
        const char* what = bad == 0 ? "the reserved page" : "an out-of-range page";
        throw std::invalid_argument("free of " + std::string(what) + " " + std::to_string(bad) +
                                    " (allocatable: 1.." + std::to_string(num_pages_ - 1) + ")");
    }
    for (int64_t p : pages)
        if (is_free_[p]) throw std::invalid_argument("double free of page " + std::to_string(p));
    const int64_t n = static_cast<int64_t>(pages.size());
    const int64_t in_use = total_pages() - top_;
    if (n > in_use)  // more than are in use: some page is repeated
        throw std::invalid_argument(std::to_string(n) + " pages freed but only " +
                                    std::to_string(in_use) + " are in use");
    // The first page that appears again later in the call.
    std::unordered_map<int64_t, int64_t> last;
    for (int64_t i = 0; i < n; ++i) last[pages[i]] = i;
    for (int64_t i = 0; i < n; ++i)
        if (last[pages[i]] != i)
            throw std::invalid_argument("page " + std::to_string(pages[i]) +
                                        " freed twice in one call");
    throw std::logic_error("explain_bad_free: no error found");
}

void PageAllocator::unstage(int64_t staged) {
    for (int64_t j = 0; j < staged; ++j) is_free_[stack_[top_ + j]] = 0;
}

void PageAllocator::Staged::put(const int32_t* pages, int64_t n) {
    if (!bad_ && a_.stage(pages, n, staged_)) {
        staged_ += n;
        return;
    }
    if (!bad_) {  // keep every page for the error: the staged ones are above the top
        bad_ = true;
        const int32_t* staged = a_.stack_.data() + a_.top_;
        failed_.assign(staged, staged + staged_);
        a_.unstage(staged_);
        staged_ = 0;
    }
    failed_.insert(failed_.end(), pages, pages + n);
}

void PageAllocator::Staged::finish() {
    if (bad_) a_.explain_bad_free(failed_);
    a_.top_ += staged_;
    staged_ = 0;
}

void PageAllocator::check_integrity() const {
    if (top_ < 0 || top_ > total_pages())
        throw IntegrityError("free count " + std::to_string(top_) + " out of range");
    std::vector<int32_t> free(stack_.begin(), stack_.begin() + top_);
    std::sort(free.begin(), free.end());
    if (std::adjacent_find(free.begin(), free.end()) != free.end())
        throw IntegrityError("a page is on the free list twice");
    if (is_free_[0]) throw IntegrityError("the reserved page is marked free");
    std::vector<int32_t> marked;
    for (int64_t p = 0; p < num_pages_; ++p)
        if (is_free_[p]) marked.push_back(static_cast<int32_t>(p));
    if (free != marked) throw IntegrityError("free list and is_free map disagree");
}

}  // namespace radix
