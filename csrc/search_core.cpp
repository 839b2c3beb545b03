// The C++ search core; see search_core.hpp. Each function names its Python twin.
#include "search_core.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>

namespace realign_core {

namespace {

void fail(const std::string& field, const std::string& msg) {
    throw std::invalid_argument(field + ": " + msg);
}

// Up to this many GPUs, per-GPU arrays (a loop over a mesh's GPUs is cheaper than
// finding its runs); above, runs of GPUs (FreeTimes, memory()).
constexpr i64 kPerGpuUpTo = 64;

}  // namespace

// ---- Problem::validate -----------------------------------------------------------

void Problem::validate() const {
    const i64 n_mfc = n_mfcs();
    const i64 n_models = static_cast<i64>(realloc_models.size());
    if (n_gpus < 1) fail("n_gpus", std::to_string(n_gpus) + " is not >= 1");
    if (!(mem_limit_bytes > 0.0)) fail("mem_limit_bytes", "must be > 0");
    if (n_iters < 1) fail("n_iters", std::to_string(n_iters) + " is not >= 1");
    if (!(step_overhead_s >= 0.0)) fail("step_overhead_s", "must be >= 0");
    if (links.gpus_per_node < 1) fail("links.gpus_per_node", "must be >= 1");
    if (!(links.intra_bytes_per_s > 0.0) || !(links.inter_bytes_per_s > 0.0))
        fail("links", "bandwidths must be > 0");
    if (static_cast<i64>(mfc_model.size()) != n_mfc ||
        static_cast<i64>(mfc_is_train.size()) != n_mfc ||
        static_cast<i64>(deps.size()) != n_mfc || static_cast<i64>(mesh_groups.size()) != n_mfc ||
        static_cast<i64>(mesh_of.size()) != n_mfc)
        fail("mfc_model/mfc_is_train/deps/mesh_groups/mesh_of",
             "need one entry per MFC (" + std::to_string(n_mfc) + ")");
    if (static_cast<i64>(model_train_mfc.size()) != n_models)
        fail("model_train_mfc", "needs one entry per model (" + std::to_string(n_models) + ")");
    for (i64 i = 0; i < n_mfc; ++i)
        if (mfc_model[i] < 0 || mfc_model[i] >= n_models)
            fail("mfc_model[" + std::to_string(i) + "]",
                 std::to_string(mfc_model[i]) + " is not a model index");
    for (i64 m = 0; m < n_models; ++m) {
        const i64 t = model_train_mfc[m];
        if (t < -1 || t >= n_mfc || (t >= 0 && mfc_model[t] != m))
            fail("model_train_mfc[" + std::to_string(m) + "]",
                 std::to_string(t) + " is not -1 or a train MFC of this model");
        const ReallocModel& rm = realloc_models[m];
        if (rm.n_layers < 1) fail("realloc_models[" + std::to_string(m) + "].n_layers", "must be >= 1");
        if (rm.head_kind < kHeadLmUntied || rm.head_kind > kHeadValue)
            fail("realloc_models[" + std::to_string(m) + "].head_kind", "must be 0, 1 or 2");
    }
    for (i64 i = 0; i < n_mfc; ++i) {
        const std::string at = "[" + std::to_string(i) + "]";
        for (i64 d : deps[i])
            if (d < 0 || d >= n_mfc) fail("deps" + at, std::to_string(d) + " is not an MFC index");
        const i64 n_c = static_cast<i64>(cands[i].size());
        if (n_c < 1) fail("cands" + at, "an MFC needs at least one candidate");
        if (static_cast<i64>(mesh_of[i].size()) != n_c)
            fail("mesh_of" + at, "needs one group index per candidate");
        const i64 n_g = static_cast<i64>(mesh_groups[i].size());
        for (i64 q = 0; q < n_g; ++q) {
            const std::string gat = at + "[" + std::to_string(q) + "]";
            if (mesh_groups[i][q].empty()) fail("mesh_groups" + gat, "must not be empty");
            for (i64 k : mesh_groups[i][q])
                if (k < 0 || k >= n_c) fail("mesh_groups" + gat, std::to_string(k) + " is not a candidate index");
        }
        const ReallocModel& rm = realloc_models[mfc_model[i]];
        for (i64 j = 0; j < n_c; ++j) {
            const std::string cat = at + "[" + std::to_string(j) + "]";
            const Place& p = cands[i][j].place;
            if (p.tp < 1 || p.pp < 1 || p.dp < 1 || p.tp * p.pp * p.dp != p.n_gpus)
                fail("cands" + cat, "needs tp, pp, dp >= 1 with tp * pp * dp == n_gpus");
            if (p.ep < 1 || p.dp % p.ep != 0) fail("cands" + cat, "needs ep >= 1 dividing dp");
            if (p.first_gpu < 0 || p.first_gpu + p.n_gpus > n_gpus)
                fail("cands" + cat, "mesh lies outside the cluster's " + std::to_string(n_gpus) + " GPUs");
            // realloc_time divides n_layers // pp (Python would raise ZeroDivisionError).
            if (p.pp > rm.n_layers) fail("cands" + cat, "pp exceeds the model's n_layers");
            if (mesh_of[i][j] < 0 || mesh_of[i][j] >= n_g)
                fail("mesh_of" + cat, std::to_string(mesh_of[i][j]) + " is not a group index");
        }
    }
    const i64 n_keys = static_cast<i64>(key_send_intra_s.size());
    if (static_cast<i64>(key_send_inter_s.size()) != n_keys)
        fail("key_send_inter_s", "needs one entry per key, like key_send_intra_s");
    if (static_cast<i64>(inputs.size()) != n_mfc || static_cast<i64>(outputs.size()) != n_mfc ||
        static_cast<i64>(mfc_every.size()) != n_mfc || static_cast<i64>(ahead.size()) != n_mfc)
        fail("inputs/outputs/mfc_every/ahead", "need one entry per MFC (" + std::to_string(n_mfc) + ")");
    for (i64 i = 0; i < n_mfc; ++i) {
        const std::string at = "[" + std::to_string(i) + "]";
        if (mfc_every[i] < 1) fail("mfc_every" + at, "must be >= 1");
        for (const auto& kp : inputs[i])
            if (kp[0] < 0 || kp[0] >= n_keys || kp[1] < -1 || kp[1] >= n_mfc)
                fail("inputs" + at, "needs (key index, MFC index or -1)");
        for (i64 k : outputs[i])
            if (k < 0 || k >= n_keys) fail("outputs" + at, std::to_string(k) + " is not a key index");
    }
    if (!(links.copy_bytes_per_s > 0.0) || !(links.fixed_s >= 0.0))
        fail("links", "copy_bytes_per_s must be > 0 and fixed_s >= 0");
}

void check_assign(const Problem& prob, const std::vector<i64>& assign, const char* what) {
    if (static_cast<i64>(assign.size()) != prob.n_mfcs())
        fail(what, "has " + std::to_string(assign.size()) + " entries, need one per MFC (" +
                   std::to_string(prob.n_mfcs()) + ")");
    for (i64 i = 0; i < prob.n_mfcs(); ++i)
        if (assign[i] < 0 || assign[i] >= static_cast<i64>(prob.cands[i].size()))
            fail(std::string(what) + "[" + std::to_string(i) + "]",
                 std::to_string(assign[i]) + " is not in [0, " +
                     std::to_string(prob.cands[i].size()) + ")");
}

void Problem::index_places() {
    place_id.assign(cands.size(), {});
    n_places.assign(cands.size(), 0);
    for (size_t i = 0; i < cands.size(); ++i) {
        std::map<std::array<i64, 5>, i64> ids;
        place_id[i].reserve(cands[i].size());
        for (const Candidate& c : cands[i]) {
            const std::array<i64, 5> key{c.place.first_gpu, c.place.n_gpus, c.place.tp, c.place.pp,
                                         c.place.ep};
            place_id[i].push_back(ids.emplace(key, static_cast<i64>(ids.size())).first->second);
        }
        n_places[i] = static_cast<i64>(ids.size());
    }
}

// ---- planner.search.simulator.ReallocCache ----------------------------------------------

ReallocCache::ReallocCache(const Problem& prob)
    : prob_(prob), tables_(prob.cands.size()), shapes_(prob.cands.size()) {}

ReallocCost ReallocCache::get(i64 model, i64 train_mfc, i64 src, i64 mfc, i64 dst) {
    auto& table = tables_[mfc];
    const u64 key = static_cast<u64>(prob_.place_id[train_mfc][src]) *
                        static_cast<u64>(prob_.n_places[mfc]) +
                    static_cast<u64>(prob_.place_id[mfc][dst]);
    auto hit = table.find(key);
    if (hit != table.end()) return hit->second;
    Place a = prob_.cands[train_mfc][src].place, b = prob_.cands[mfc][dst].place;
    const i64 gpn = prob_.links.gpus_per_node;
    const i64 down = std::min(a.first_gpu, b.first_gpu) / gpn * gpn;
    a.first_gpu -= down;
    b.first_gpu -= down;
    const Shape shape{a.first_gpu, a.n_gpus, a.tp, a.pp, a.ep,
                      b.first_gpu, b.n_gpus, b.tp, b.pp, b.ep};
    auto& shapes = shapes_[mfc];
    auto same = shapes.find(shape);
    const ReallocCost cost = same != shapes.end()
        ? same->second
        : shapes.emplace(shape, realloc_time(prob_.realloc_models[model], a, b, prob_.links))
              .first->second;
    table.emplace(key, cost);
    return cost;
}

// ---- simulator: planner/search/simulator.py ---------------------------------------------

// planner.search.simulator.needs_realloc
bool needs_realloc(const Problem& prob, const std::vector<i64>& assign, i64 i) {
    if (prob.mfc_base[i]) return false;  // the base with its adapters off: nothing trained moves
    return off_training_placement(prob, assign, i);
}

// planner.search.simulator.off_training_placement
bool off_training_placement(const Problem& prob, const std::vector<i64>& assign, i64 i) {
    const i64 model = prob.mfc_model[i];
    const i64 t = prob.model_train_mfc[model];
    if (t < 0 || t == i) return false;
    const Place& a = prob.cands[t][assign[t]].place;
    const Place& b = prob.cands[i][assign[i]].place;
    return a.first_gpu != b.first_gpu || a.n_gpus != b.n_gpus || a.tp != b.tp || a.pp != b.pp ||
           a.ep != b.ep;
}

// planner.search.simulator.memory
double memory(const Problem& prob, const std::vector<i64>& assign,
              std::vector<double>& peak_bytes) {
    const i64 n = prob.n_gpus;
    // scratch, as in simulate() (named once: see there)
    thread_local std::vector<double> resident_tl, transient_tl;
    thread_local std::vector<std::array<i64, 6>> seen_tl;
    thread_local std::vector<i64> cuts_tl;
    std::vector<double>&resident = resident_tl, &transient = transient_tl;
    std::vector<std::array<i64, 6>>& seen = seen_tl;  // (model, first_gpu, n_gpus, tp, pp, ep)
    // the plan's meshes cut the cluster into runs of GPUs that hold the same calls, so
    // the same bytes: one entry per run (run k: GPUs [cuts[k], cuts[k + 1]))
    std::vector<i64>& cuts = cuts_tl;
    // (up to kPerGpuUpTo GPUs, one run per GPU)
    const bool per_gpu = n <= kPerGpuUpTo;
    cuts.resize(static_cast<size_t>(n) + 1);
    if (per_gpu) {
        for (i64 g = 0; g <= n; ++g) cuts[g] = g;
    } else {
        cuts.assign({0, n});
        for (i64 i = 0; i < prob.n_mfcs(); ++i) {
            const Place& p = prob.cands[i][assign[i]].place;
            cuts.push_back(p.first_gpu);
            cuts.push_back(p.first_gpu + p.n_gpus);
        }
        std::sort(cuts.begin(), cuts.end());
        cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    }
    const auto run = [&](i64 g) {
        return per_gpu ? static_cast<size_t>(g)
                       : static_cast<size_t>(std::lower_bound(cuts.begin(), cuts.end(), g) -
                                             cuts.begin());
    };
    const size_t n_runs = cuts.size() - 1;
    resident.assign(n_runs, 0.0);
    transient.assign(n_runs, 0.0);
    seen.clear();
    for (i64 i = 0; i < prob.n_mfcs(); ++i) {
        const Candidate& c = prob.cands[i][assign[i]];
        const i64 model = prob.mfc_model[i];
        const bool trained = prob.model_train_mfc[model] >= 0;
        double add_res = 0.0;
        if (prob.mfc_is_train[i]) {
            add_res = c.resident_bytes;
        } else if (!trained) {
            const std::array<i64, 6> key{model, c.place.first_gpu, c.place.n_gpus, c.place.tp,
                                         c.place.pp, c.place.ep};
            if (std::find(seen.begin(), seen.end(), key) == seen.end()) {
                seen.push_back(key);
                add_res = c.resident_bytes;
            }
        }
        if (prob.mfc_base[i] && off_training_placement(prob, assign, i)) {
            // the base with its adapters off, away from training: the base stays here
            const std::array<i64, 6> key{model, c.place.first_gpu, c.place.n_gpus, c.place.tp,
                                         c.place.pp, c.place.ep};
            if (std::find(seen.begin(), seen.end(), key) == seen.end()) {
                seen.push_back(key);
                add_res = c.resident_bytes;
            }
        }
        double tr = c.activation_bytes;
        if (trained && !prob.mfc_is_train[i] && needs_realloc(prob, assign, i)) {
            if (prob.model_lora[model]) {  // LoRA: the frozen base stays on each placement
                const std::array<i64, 6> key{model, c.place.first_gpu, c.place.n_gpus,
                                             c.place.tp, c.place.pp, c.place.ep};
                if (std::find(seen.begin(), seen.end(), key) == seen.end()) {
                    seen.push_back(key);
                    add_res += c.resident_bytes;
                }
            }
            if (prob.ahead[i])  // its copy is made at the step's start, kept to its end
                add_res += c.weights_bytes;
            else
                tr = tr + c.weights_bytes;
        }
        const size_t hi = run(c.place.first_gpu + c.place.n_gpus);
        for (size_t k = run(c.place.first_gpu); k < hi; ++k) {
            resident[k] += add_res;
            if (tr > transient[k]) transient[k] = tr;
        }
    }
    peak_bytes.assign(n, 0.0);
    double over = 0.0;
    for (size_t k = 0; k < n_runs; ++k) {
        const double peak = resident[k] + transient[k];
        std::fill(peak_bytes.begin() + cuts[k], peak_bytes.begin() + cuts[k + 1], peak);
        if (peak - prob.mem_limit_bytes > over) over = peak - prob.mem_limit_bytes;
    }
    return over;
}

namespace {

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
double latest_free(const FreeTimes& free, const Place& p, double t) {
    return free.latest(p.first_gpu, p.first_gpu + p.n_gpus, t);
}

void occupy_until(FreeTimes& free, const Place& p, double t) {
    free.set(p.first_gpu, p.first_gpu + p.n_gpus, t);
}

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

}  // namespace

namespace {

// A set of GPUs as sorted, disjoint, non-touching intervals [lo, hi): who holds a record.
// Holders are whole meshes and unions of meshes, so a few intervals stand for what the
// Python twin keeps as a sorted tuple of GPUs (same sets, same results).
using Spans = std::vector<std::pair<i64, i64>>;

i64 span_count(const Spans& s) {
    i64 n = 0;
    for (const auto& [a, b] : s) n += b - a;
    return n;
}

// [lo, hi) minus `have`
void span_minus(i64 lo, i64 hi, const Spans& have, Spans& out) {
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
void span_prefix(const Spans& s, i64 k, Spans& out) {
    out.clear();
    for (const auto& [a, b] : s) {
        if (k <= 0) break;
        const i64 take = std::min(k, b - a);
        out.emplace_back(a, a + take);
        k -= take;
    }
}

// the union of two span sets, merged into sorted, disjoint, non-touching intervals
void span_union(const Spans& x, const Spans& y, Spans& out) {
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

}  // namespace

namespace {

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

// ---- annealing: planner/search/anneal.py ------------------------------------------------

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
