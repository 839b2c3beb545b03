// The simulator's state while it runs a plan: when each GPU is next free (FreeTimes)
// and which GPUs hold a record (Spans). Internal to the core (simulate.cpp and
// sim_memory.cpp); kept inline, since simulate() calls them on every step.
#pragma once

#include "search_core.hpp"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace realign_core {
namespace sim {

// Up to this many GPUs, per-GPU arrays (a loop over a mesh's GPUs is cheaper than
// finding its runs); above, runs of GPUs (FreeTimes, memory()).
constexpr i64 kPerGpuUpTo = 64;

// When each GPU is next free, held as runs of GPUs that are free at the same time: a
// plan's meshes and sends cut the cluster into a few runs, so reading and setting a
// mesh's GPUs costs the runs it spans, not its GPUs (at 1024 GPUs, most of a step's
// time was per-GPU loops). Every GPU's time is the one a per-GPU array would hold; up
// to kPerGpuUpTo GPUs it is such an array.
class FreeTimes {
public:
    // every GPU of [0, n) free at `t`
    void reset(i64 n, double t) {
        n_ = n;
        if (n <= kPerGpuUpTo) {
            per_gpu_.assign(static_cast<size_t>(n), t);
            return;
        }
        start_.assign(1, 0);
        time_.assign(1, t);
    }
    // the latest time a GPU of [lo, hi) is busy until, at least `t`
    double latest(i64 lo, i64 hi, double t) const {
        if (n_ <= kPerGpuUpTo) {
            for (i64 g = lo; g < hi; ++g)
                if (per_gpu_[g] > t) t = per_gpu_[g];
            return t;
        }
        for (size_t k = run_of(lo); k < start_.size() && start_[k] < hi; ++k)
            if (time_[k] > t) t = time_[k];
        return t;
    }
    // every GPU of [lo, hi) busy until `t`
    void set(i64 lo, i64 hi, double t) {
        if (lo >= hi) return;
        if (n_ <= kPerGpuUpTo) {
            std::fill(per_gpu_.begin() + lo, per_gpu_.begin() + hi, t);
            return;
        }
        if (hi < n_) split_at(hi);
        const size_t k = split_at(lo);
        size_t e = k + 1;
        while (e < start_.size() && start_[e] < hi) ++e;
        start_.erase(start_.begin() + static_cast<std::ptrdiff_t>(k + 1),
                     start_.begin() + static_cast<std::ptrdiff_t>(e));
        time_.erase(time_.begin() + static_cast<std::ptrdiff_t>(k + 1),
                    time_.begin() + static_cast<std::ptrdiff_t>(e));
        time_[k] = t;
    }

private:
    // the run that holds GPU g
    size_t run_of(i64 g) const {
        const auto it = std::upper_bound(start_.begin(), start_.end(), g);
        return static_cast<size_t>(it - start_.begin()) - 1;
    }
    // a run starts at g (splitting the run that held it); its index
    size_t split_at(i64 g) {
        const size_t k = run_of(g);
        if (start_[k] == g) return k;
        start_.insert(start_.begin() + static_cast<std::ptrdiff_t>(k + 1), g);
        time_.insert(time_.begin() + static_cast<std::ptrdiff_t>(k + 1), time_[k]);
        return k + 1;
    }
    std::vector<i64> start_;   // run k: GPUs [start_[k], start_[k + 1]) (the last to n_)
    std::vector<double> time_;
    std::vector<double> per_gpu_;   // up to kPerGpuUpTo GPUs
    i64 n_ = 0;
};

// The latest time any GPU of [first, first + n) is busy until, at least `t`.
inline double latest_free(const FreeTimes& free, const Place& p, double t) {
    return free.latest(p.first_gpu, p.first_gpu + p.n_gpus, t);
}

inline void occupy_until(FreeTimes& free, const Place& p, double t) {
    free.set(p.first_gpu, p.first_gpu + p.n_gpus, t);
}

// A set of GPUs as sorted, disjoint, non-touching intervals [lo, hi): who holds a record.
// Holders are whole meshes and unions of meshes, so a few intervals stand for what the
// Python twin keeps as a sorted tuple of GPUs (same sets, same results).
using Spans = std::vector<std::pair<i64, i64>>;

inline i64 span_count(const Spans& s) {
    i64 n = 0;
    for (const auto& [a, b] : s) n += b - a;
    return n;
}

// [lo, hi) minus `have`
inline void span_minus(i64 lo, i64 hi, const Spans& have, Spans& out) {
    out.clear();
    i64 at = lo;
    for (const auto& [a, b] : have) {
        if (b <= at) continue;
        if (a >= hi) break;
        if (a > at) out.emplace_back(at, a);
        at = std::max(at, b);
        if (at >= hi) break;
    }
    if (at < hi) out.emplace_back(at, hi);
}

// the first `k` GPUs of `s`
inline void span_prefix(const Spans& s, i64 k, Spans& out) {
    out.clear();
    for (const auto& [a, b] : s) {
        if (k <= 0) break;
        const i64 take = std::min(k, b - a);
        out.emplace_back(a, a + take);
        k -= take;
    }
}

// the union of two span sets, merged into sorted, disjoint, non-touching intervals
inline void span_union(const Spans& x, const Spans& y, Spans& out) {
    out.clear();
    auto push = [&](std::pair<i64, i64> iv) {
        if (!out.empty() && iv.first <= out.back().second)
            out.back().second = std::max(out.back().second, iv.second);
        else
            out.push_back(iv);
    };
    size_t i = 0, j = 0;
    while (i < x.size() || j < y.size()) {
        if (j == y.size() || (i < x.size() && x[i].first <= y[j].first)) push(x[i++]);
        else push(y[j++]);
    }
}

}  // namespace sim
}  // namespace realign_core
