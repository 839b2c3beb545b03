// The annealing walk over a problem's plans (twin of planner/search/anneal.py).
#include "search_core.hpp"

#include <chrono>
#include <cmath>
#include <vector>

namespace realign_core {

namespace {

// One proposal of planner.search.anneal.anneal: an MFC and a candidate for it (half the
// time one on the same mesh). The random draws happen in the Python order.
struct Move {
    i64 mfc;
    i64 cand;
};

Move propose(const Problem& prob, const std::vector<i64>& cur, SplitMix64& rng) {
    const i64 i = static_cast<i64>(rng.next() % static_cast<u64>(prob.n_mfcs()));
    const std::vector<i64>& same = prob.same_mesh(i, cur[i]);
    const bool layout_move = (rng.next() & 1) != 0;
    if (layout_move && same.size() > 1)
        return {i, same[rng.next() % static_cast<u64>(same.size())]};
    return {i, static_cast<i64>(rng.next() % static_cast<u64>(prob.cands[i].size()))};
}

}  // namespace

// planner.search.anneal.anneal
AnnealResult anneal(const Problem& prob, const std::vector<i64>& start, const AnnealSettings& s,
                    double time_limit_s, ReallocCache* shared) {
    using clock = std::chrono::steady_clock;
    const auto t_start = clock::now();
    SplitMix64 rng(s.seed);
    ReallocCache own(prob);
    ReallocCache& cache = shared != nullptr ? *shared : own;
    std::vector<i64> cur = start;
    const SimResult res = simulate(prob, cur, cache);
    double cur_e = energy(prob, res);
    std::vector<i64> best = cur;
    double best_e = res.feasible() ? cur_e : kInf;
    const double t0 = s.t0_frac * cur_e;
    const double t1 = s.t1_frac * cur_e;
    i64 accepted = 0;
    i64 step = 0;
    i64 improved_at = 0;     // the step of the last better plan (the start: 0)
    for (; step < s.n_steps; ++step) {
        if (time_limit_s > 0.0 && step > 0 && step % kTimeCheckEvery == 0 &&
            std::chrono::duration<double>(clock::now() - t_start).count() >= time_limit_s)
            break;
        if (s.patience > 0 && step - improved_at >= s.patience) break;     // converged
        if (s.restart_every > 0 && step > 0 && step % s.restart_every == 0 && best_e < kInf) {
            cur = best;
            cur_e = best_e;
        }
        const double temp = t0 * std::pow(t1 / t0, static_cast<double>(step) /
                                                       static_cast<double>(s.n_steps));
        const Move mv = propose(prob, cur, rng);
        if (mv.cand == cur[mv.mfc]) continue;
        const i64 old = cur[mv.mfc];
        cur[mv.mfc] = mv.cand;
        const SimResult r = simulate(prob, cur, cache);
        const double e = energy(prob, r);
        if (e <= cur_e || rng.uniform() < std::exp((cur_e - e) / temp)) {
            cur_e = e;
            accepted += 1;
            if (r.feasible() && e < best_e) {
                best_e = e;
                best = cur;
                improved_at = step;
            }
        } else {
            cur[mv.mfc] = old;
        }
    }
    AnnealResult out;
    out.assign = std::move(best);
    out.energy = best_e;
    out.feasible = best_e < kInf;
    out.steps = step;
    out.accepted = accepted;
    return out;
}

}  // namespace realign_core
