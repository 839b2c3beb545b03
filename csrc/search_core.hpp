// The C++ search core: the simulator, the reallocation cost and the annealer.
//
// Every function here is a line-by-line twin of a Python function in planner/
// (named in its comment) and must return bit-identical numbers: same integer byte
// arithmetic, same floating-point operations in the same order, the same random
// numbers. tests/planner/test_core_twin.py feeds both the same random problems.
// Built with -ffp-contract=off and without -ffast-math so that no FMA or
// reassociation changes a rounding.
#pragma once

#include "flat_table.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace realign_core {

using i64 = std::int64_t;
using u64 = std::uint64_t;

constexpr double kInf = std::numeric_limits<double>::infinity();

// planner.search.simulator.OVERFLOW_PENALTY
constexpr double kOverflowPenalty = 10.0;

// planner.cost.realloc_cost.HEAD_LM_UNTIED / HEAD_LM_TIED / HEAD_VALUE
enum HeadKind : int { kHeadLmUntied = 0, kHeadLmTied = 1, kHeadValue = 2 };

// planner.cost.realloc_cost.Links
struct Links {
    i64 gpus_per_node = 1;
    double intra_bytes_per_s = 1.0;
    double inter_bytes_per_s = 1.0;
    double intra_latency_s = 0.0;
    double inter_latency_s = 0.0;
    double fixed_s = 0.0;
    double copy_bytes_per_s = kInf;
};

// planner.cost.realloc_cost.ReallocModel (bytes are exact integers, as in Python)
struct ReallocModel {
    i64 n_layers = 1;
    i64 layer_sharded_bytes = 0;
    i64 layer_replicated_bytes = 0;
    i64 embedding_bytes = 0;
    i64 final_norm_bytes = 0;
    int head_kind = kHeadLmUntied;
    i64 head_bytes = 0;
    i64 layer_expert_bytes = 0;  // every expert of one layer (split over TP and EP)
    std::vector<i64> dense_layers;  // a mixture of experts' dense-MLP layers (increasing)
    i64 dense_layer_sharded_bytes = 0;
    i64 dense_layer_replicated_bytes = 0;

    // planner.cost.realloc_cost.ReallocModel.dense_in
    i64 dense_in(i64 lo, i64 hi) const {
        i64 n = 0;
        for (i64 x : dense_layers) n += lo <= x && x < hi;
        return n;
    }
};

// planner.cost.realloc_cost.Place: (first_gpu, n_gpus, tp, pp, dp, ep)
struct Place {
    i64 first_gpu = 0;
    i64 n_gpus = 1;
    i64 tp = 1;
    i64 pp = 1;
    i64 dp = 1;
    i64 ep = 1;  // expert parallelism within dp (a mixture of experts)
};

// planner.search.problem.Candidate (the fields the simulator reads)
struct Candidate {
    Place place;
    double time_s = 0.0;
    double time_sd_s = 0.0;     // spread over steps (asynchronous graphs with lengths)
    double resident_bytes = 0.0;
    double activation_bytes = 0.0;
    double weights_bytes = 0.0;
};

// planner.search.problem.Problem in numbers. Built once (see planner/search/core_bridge.py) and
// checked by validate(); read-only afterwards, so several threads may share it.
struct Problem {
    i64 n_gpus = 0;
    double mem_limit_bytes = 0.0;
    i64 n_iters = 1;
    double step_overhead_s = 0.0;   // host seconds between two steps (the step barrier)
    Links links;
    std::vector<i64> mfc_model;                      // per MFC: model index
    std::vector<bool> mfc_is_train;                  // per MFC
    std::vector<std::vector<i64>> deps;              // per MFC: MFCs it reads from
    std::vector<i64> model_train_mfc;                // per model: train MFC or -1
    std::vector<bool> model_lora;                    // per model: LoRA (frozen base stays put)
    std::vector<bool> mfc_base;                      // per MFC: its model's base, adapters off
    std::vector<ReallocModel> realloc_models;        // per model
    std::vector<std::vector<Candidate>> cands;       // per MFC: its candidates
    // per MFC: the groups of candidates on one mesh, and per candidate the index of its
    // group (planner.search.problem.Problem.same_mesh, each group held once)
    std::vector<std::vector<std::vector<i64>>> mesh_groups;
    std::vector<std::vector<i64>> mesh_of;
    // the candidates of MFC i on the mesh of its candidate j (j among them)
    const std::vector<i64>& same_mesh(i64 i, i64 j) const { return mesh_groups[i][mesh_of[i][j]]; }
    // per MFC, per cand: the index of its placement (first_gpu, n_gpus, tp, pp, ep) among the
    // MFC's distinct placements, and their number (index_places() fills them)
    std::vector<std::vector<i64>> place_id;
    std::vector<i64> n_places;
    // records (planner.search.problem._add_records): per MFC its (key, producer MFC or -1)
    // inputs, its output keys and its `every`; per key one Send's seconds
    std::vector<std::vector<std::array<i64, 2>>> inputs;
    std::vector<std::vector<i64>> outputs;
    std::vector<i64> mfc_every;
    std::vector<bool> ahead;                         // per MFC: runs ahead of training
    std::vector<double> key_send_intra_s;
    std::vector<double> key_send_inter_s;

    i64 n_mfcs() const { return static_cast<i64>(cands.size()); }

    // Throws std::invalid_argument naming the offending field and value.
    void validate() const;
    // Fills place_id and n_places from cands.
    void index_places();
};

// ---- reallocation cost (planner/cost/realloc_cost.py) ---------------------------------

struct ReallocCost {
    double time_s = 0.0;
    i64 bytes = 0;
};

// planner.cost.realloc_cost.realloc_time
ReallocCost realloc_time(const ReallocModel& m, const Place& src, const Place& dst,
                         const Links& links);

// planner.search.simulator.ReallocCache: memoised realloc_time keyed by
// (model, source placement, destination placement): candidates that differ only in
// micro-batches or offload share one entry. The model is fixed by the MFC, so there is
// one table per MFC keyed by (source placement, destination placement). Behind it, one
// per MFC keyed by the two placements moved down together by whole nodes (the lower
// first GPU to node 0): realloc_time reads GPU numbers only through their node and their
// distance from the meshes' first GPUs, so such a pair costs exactly the same, and a
// pair of meshes is priced once however far along the cluster it lies; a pair on separate
// nodes is keyed with the gap between them closed (its bytes all cross nodes, and the
// price is the same however many nodes lie between).
class ReallocCache {
public:
    explicit ReallocCache(const Problem& prob);
    ReallocCost get(i64 model, i64 train_mfc, i64 src, i64 mfc, i64 dst);

private:
    const Problem& prob_;
    std::vector<FlatTable<ReallocCost>> tables_;  // per MFC
    // (src first, n, tp, pp, ep, dst first, n, tp, pp, ep) moved down by whole nodes
    using Shape = std::array<i64, 10>;
    struct ShapeHash {
        std::size_t operator()(const Shape& k) const {
            u64 h = 1469598103934665603ULL;
            for (i64 v : k) h = (h ^ static_cast<u64>(v)) * 1099511628211ULL;
            return static_cast<std::size_t>(h);
        }
    };
    std::vector<std::unordered_map<Shape, ReallocCost, ShapeHash>> shapes_;  // per MFC
};

// ---- simulator (planner/search/simulator.py) --------------------------------------------

struct SimResult {
    double iter_time_s = 0.0;
    double makespan_s = 0.0;
    double overflow_bytes = 0.0;
    std::vector<double> peak_bytes;

    bool feasible() const { return overflow_bytes <= 0.0; }
};

// planner.search.simulator.needs_realloc
bool needs_realloc(const Problem& prob, const std::vector<i64>& assign, i64 i);
// planner.search.simulator.off_training_placement
bool off_training_placement(const Problem& prob, const std::vector<i64>& assign, i64 i);

// planner.search.simulator.memory: fills peak_bytes and returns the worst overflow.
double memory(const Problem& prob, const std::vector<i64>& assign,
              std::vector<double>& peak_bytes);

// planner.search.simulator.simulate (record=False)
SimResult simulate(const Problem& prob, const std::vector<i64>& assign, ReallocCache& cache);

// planner.search.simulator.energy
double energy(const Problem& prob, const SimResult& res);

// Throws std::invalid_argument unless assign has one valid candidate index per MFC.
void check_assign(const Problem& prob, const std::vector<i64>& assign, const char* what);

// ---- annealing (planner/search/anneal.py) -----------------------------------------------

// planner.search.anneal.SplitMix64
class SplitMix64 {
public:
    explicit SplitMix64(u64 seed) : state_(seed) {}

    u64 next() {
        state_ += 0x9E3779B97F4A7C15ULL;
        u64 z = state_;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }

    // A double in [0, 1) from the top 53 bits.
    double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }

private:
    u64 state_;
};

// planner.search.anneal.AnnealSettings
struct AnnealSettings {
    i64 n_steps = 20000;
    double t0_frac = 0.05;
    double t1_frac = 1e-4;
    i64 restart_every = 5000;
    u64 seed = 0;
    i64 patience = 0;   // > 0: stop once this many steps found no better plan (converged)
};

// planner.search.anneal.AnnealResult (steps: the steps actually run)
struct AnnealResult {
    std::vector<i64> assign;
    double energy = kInf;
    bool feasible = false;
    i64 steps = 0;
    i64 accepted = 0;
};

// planner.search.anneal.anneal. time_limit_s <= 0: no limit; otherwise the walk stops at
// the first check (every kTimeCheckEvery steps) past the limit.
constexpr i64 kTimeCheckEvery = 256;
// `cache`: reallocation times kept across calls (null: one of its own).
AnnealResult anneal(const Problem& prob, const std::vector<i64>& start,
                    const AnnealSettings& s, double time_limit_s,
                    ReallocCache* cache = nullptr);

// A problem's simulator with its reallocation cache kept from call to call (the
// search prices the heuristics, the seeds and every annealing chain through one).
struct Simulator {
    explicit Simulator(const Problem& p) : prob(p), cache(p) {}
    const Problem& prob;
    ReallocCache cache;
};

}  // namespace realign_core
