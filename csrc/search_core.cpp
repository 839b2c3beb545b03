// The C++ search core; see search_core.hpp. Each function names its Python twin.
// Here: the problem's checks and indexes and the reallocation cache; the simulator's
// state is in sim_state.hpp, its memory in sim_memory.cpp, its timeline in
// simulate.cpp, the annealing in anneal.cpp, the reallocation cost in realloc_cost.cpp.
#include "search_core.hpp"

#include <algorithm>
#include <array>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>

namespace realign_core {

namespace {

void fail(const std::string& field, const std::string& msg) {
    throw std::invalid_argument(field + ": " + msg);
}

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
    if (const ReallocCost* hit = table.find(key)) return *hit;
    Place a = prob_.cands[train_mfc][src].place, b = prob_.cands[mfc][dst].place;
    const i64 gpn = prob_.links.gpus_per_node;
    const i64 down = std::min(a.first_gpu, b.first_gpu) / gpn * gpn;
    a.first_gpu -= down;
    b.first_gpu -= down;
    // on separate nodes, no GPU of one mesh shares a node with the other's: every byte
    // crosses nodes and realloc_time reads neither mesh's position, so the upper mesh
    // moves down to the node after the lower one's last (one entry however far apart)
    const i64 a_lo = a.first_gpu / gpn, a_hi = (a.first_gpu + a.n_gpus - 1) / gpn;
    const i64 b_lo = b.first_gpu / gpn, b_hi = (b.first_gpu + b.n_gpus - 1) / gpn;
    if (a_hi < b_lo) b.first_gpu -= (b_lo - a_hi - 1) * gpn;
    else if (b_hi < a_lo) a.first_gpu -= (a_lo - b_hi - 1) * gpn;
    const Shape shape{a.first_gpu, a.n_gpus, a.tp, a.pp, a.ep,
                      b.first_gpu, b.n_gpus, b.tp, b.pp, b.ep};
    auto& shapes = shapes_[mfc];
    auto same = shapes.find(shape);
    const ReallocCost cost = same != shapes.end()
        ? same->second
        : shapes.emplace(shape, realloc_time(prob_.realloc_models[model], a, b, prob_.links))
              .first->second;
    table.insert(key, cost);
    return cost;
}

}  // namespace realign_core
