// The simulator's timeline: a plan's steps, its calls, sends and reallocations on
// the GPUs' free times (twin of planner.search.simulator.simulate), and its energy.
#include "search_core.hpp"
#include "sim_state.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace realign_core {

using sim::FreeTimes;
using sim::Spans;
using sim::latest_free;
using sim::occupy_until;
using sim::span_count;
using sim::span_minus;
using sim::span_prefix;
using sim::span_union;

namespace {

// planner.cost.step_spread.expected_max: Clark's E[max] of two independent normals
double expected_max(double m1, double s1, double m2, double s2) {
    const double theta = std::sqrt(s1 * s1 + s2 * s2);
    if (theta <= 0.0) return std::max(m1, m2);
    const double a = (m1 - m2) / theta;
    const double cdf = 0.5 * std::erfc(-a / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * a * a) / std::sqrt(2.0 * M_PI);
    return m1 * cdf + m2 * (1.0 - cdf) + theta * pdf;
}

// planner.search.simulator._slower_side_end: an asynchronous step's expected end
double slower_side_end(const Problem& prob, const std::vector<i64>& assign,
                       const std::vector<double>& finish) {
    double gen_end = 0.0, train_end = 0.0, gen_var = 0.0, train_sd = 0.0;
    for (i64 i = 0; i < prob.n_mfcs(); ++i) {
        const double sd = prob.cands[i][assign[i]].time_sd_s;
        if (prob.ahead[i]) {
            gen_end = std::max(gen_end, finish[i]);
            gen_var += sd * sd;
        } else {
            train_end = std::max(train_end, finish[i]);
            train_sd += sd;
        }
    }
    return expected_max(gen_end, std::sqrt(gen_var), train_end, train_sd);
}

// simulate()'s scratch buffers, one set per thread
struct Scratch {
    FreeTimes free;
    std::vector<double> prev_finish, finish, ahead_ready;
    std::vector<Spans> holders;
    std::vector<bool> held;
    Spans lack, first, occ, merged;
    std::vector<i64> order, ahead;
};

}  // namespace

// planner.search.simulator.simulate (record=False; the realloc table is not kept)
SimResult simulate(const Problem& prob, const std::vector<i64>& assign, ReallocCache& cache) {
    const i64 n_mfc = prob.n_mfcs();
    const i64 n_keys = static_cast<i64>(prob.key_send_intra_s.size());
    const i64 gpn = prob.links.gpus_per_node;
    // Scratch buffers, kept per thread from call to call: a call is a few microseconds,
    // and a dozen allocations a call were a fifth of it. Each is reset before use.
    thread_local Scratch scratch;
    // named once here: each use of a thread_local in a shared library is a call to
    // __tls_get_addr, a twentieth of a step at 128 GPUs
    FreeTimes& free = scratch.free;
    std::vector<double>&prev_finish = scratch.prev_finish, &finish = scratch.finish,
                       &ahead_ready = scratch.ahead_ready;
    std::vector<Spans>& holders = scratch.holders;
    std::vector<bool>& held = scratch.held;
    Spans &lack = scratch.lack, &first = scratch.first, &occ = scratch.occ,
          &merged = scratch.merged;
    std::vector<i64>&order = scratch.order, &ahead = scratch.ahead;
    free.reset(prob.n_gpus, 0.0);
    prev_finish.assign(n_mfc, 0.0);
    finish.assign(n_mfc, 0.0);
    holders.resize(n_keys);
    for (Spans& h : holders) h.clear();
    held.assign(n_keys, false);
    order.clear();
    ahead.clear();
    for (i64 i = 0; i < n_mfc; ++i)
        if (!prob.ahead[i]) order.push_back(i); else ahead.push_back(i);
    order.insert(order.end(), ahead.begin(), ahead.end());
    ahead_ready.assign(n_mfc, 0.0);
    double makespan = 0.0;
    // the reallocation before MFC i on both placements (step `it`); its end
    auto realloc = [&](i64 it, i64 i) {
        const Candidate& c = prob.cands[i][assign[i]];
        const i64 model = prob.mfc_model[i];
        const i64 t = prob.model_train_mfc[model];
        const Place& src = prob.cands[t][assign[t]].place;
        const ReallocCost r = cache.get(model, t, assign[t], i, assign[i]);
        const double r_ready = it > 0 ? prev_finish[t] : 0.0;
        double r_start = latest_free(free, src, r_ready);
        r_start = latest_free(free, c.place, r_start);
        const double r_end = r_start + r.time_s;
        occupy_until(free, src, r_end);
        occupy_until(free, c.place, r_end);
        return r_end;
    };
    // record `key` sent to the GPUs of MFC i's mesh that lack it (occupying them and
    // as many holders); its end (0: nothing to send)
    auto send = [&](i64 i, i64 key) {
        const Candidate& c = prob.cands[i][assign[i]];
        const i64 lo = c.place.first_gpu, hi = c.place.first_gpu + c.place.n_gpus;
        const Spans& have = holders[key];
        span_minus(lo, hi, have, lack);          // the mesh's GPUs that lack the record
        if (lack.empty()) return 0.0;
        // occupied: as many holders as receivers (the first ones) and the receivers
        span_prefix(have, std::min(span_count(lack), span_count(have)), first);
        span_union(first, lack, occ);
        const bool inter = occ.front().first / gpn != (occ.back().second - 1) / gpn;
        const double dur = (inter ? prob.key_send_inter_s[key] : prob.key_send_intra_s[key]) /
                           static_cast<double>(prob.mfc_every[i]);
        double s_start = 0.0;
        for (const auto& [a, b] : occ) s_start = free.latest(a, b, s_start);
        const double s_end = s_start + dur;
        for (const auto& [a, b] : occ) free.set(a, b, s_end);
        if (prob.mfc_every[i] == 1) {
            span_union(have, lack, merged);
            holders[key].swap(merged);
        }
        return s_end;
    };
    for (i64 it = 0; it < prob.n_iters; ++it) {
        makespan += prob.step_overhead_s;                // between steps: controller, batches
        free.reset(prob.n_gpus, makespan);              // the step barrier
        std::fill(finish.begin(), finish.end(), 0.0);
        std::fill(held.begin(), held.end(), false);
        std::fill(ahead_ready.begin(), ahead_ready.end(), 0.0);
        for (i64 i : ahead) {
            // the previous step's rollout is on the generating mesh; the weights it
            // generates with next are reallocated first
            const Place& p = prob.cands[i][assign[i]].place;
            for (i64 key : prob.outputs[i]) {
                holders[key].assign(1, {p.first_gpu, p.first_gpu + p.n_gpus});
                held[key] = true;
            }
            if (needs_realloc(prob, assign, i)) ahead_ready[i] = realloc(it, i);
        }
        // then that rollout goes to every mesh of this step that reads it, so the
        // generating mesh is free for the next one
        for (i64 i : order) {
            if (prob.ahead[i] || prob.mfc_every[i] != 1) continue;
            for (const auto& kp : prob.inputs[i])
                if (kp[1] >= 0 && prob.ahead[kp[1]] && held[kp[0]]) send(i, kp[0]);
        }
        for (i64 i : order) {
            const Candidate& c = prob.cands[i][assign[i]];
            const i64 model = prob.mfc_model[i];
            const i64 t = prob.model_train_mfc[model];
            double ready = ahead_ready[i];
            for (i64 d : prob.deps[i])
                if (finish[d] > ready) ready = finish[d];
            if (t >= 0 && it > 0 && prev_finish[t] > ready) ready = prev_finish[t];
            if (t >= 0 && t != i && !prob.ahead[i] && needs_realloc(prob, assign, i)) {
                const double r_end = realloc(it, i);
                if (r_end > ready) ready = r_end;
            }
            const i64 lo = c.place.first_gpu, hi = c.place.first_gpu + c.place.n_gpus;
            for (const auto& kp : prob.inputs[i]) {
                if (kp[1] < 0 || !held[kp[0]]) continue;  // the dataset's (everywhere), or unscheduled
                const double s_end = send(i, kp[0]);
                if (s_end > ready) ready = s_end;
            }
            const double start = latest_free(free, c.place, ready);
            const double end = start + c.time_s;
            occupy_until(free, c.place, end);
            finish[i] = end;
            for (i64 key : prob.outputs[i]) {
                holders[key].assign(1, {lo, hi});
                held[key] = true;
            }
            if (end > makespan) makespan = end;
        }
        if (!ahead.empty()) makespan = std::max(makespan, slower_side_end(prob, assign, finish));
        std::swap(prev_finish, finish);
    }
    SimResult res;
    res.overflow_bytes = memory(prob, assign, res.peak_bytes);
    res.makespan_s = makespan;
    res.iter_time_s = makespan / static_cast<double>(prob.n_iters);
    return res;
}

// planner.search.simulator.energy
double energy(const Problem& prob, const SimResult& res) {
    return res.iter_time_s *
           (1.0 + kOverflowPenalty * res.overflow_bytes / prob.mem_limit_bytes);
}

}  // namespace realign_core
