// The simulator's memory side: which placement a call holds its model on, and the peak
// bytes per GPU of a plan (twins of planner/search/simulator.py).
#include "search_core.hpp"
#include "sim_state.hpp"

#include <algorithm>
#include <array>
#include <vector>

namespace realign_core {

using sim::kPerGpuUpTo;

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
    // scratch, as in simulate(): one thread_local, named once (each named thread_local
    // is a call to __tls_get_addr)
    struct Scratch {
        std::vector<double> resident, transient;
        std::vector<std::array<i64, 6>> seen;
        std::vector<i64> cuts;
    };
    thread_local Scratch scratch;
    Scratch& tl = scratch;
    std::vector<double>&resident = tl.resident, &transient = tl.transient;
    std::vector<std::array<i64, 6>>& seen = tl.seen;  // (model, first_gpu, n_gpus, tp, pp, ep)
    // the plan's meshes cut the cluster into runs of GPUs that hold the same calls, so
    // the same bytes: one entry per run (run k: GPUs [cuts[k], cuts[k + 1]))
    std::vector<i64>& cuts = tl.cuts;
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

}  // namespace realign_core
