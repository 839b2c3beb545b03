// The reallocation cost, a line-by-line twin of planner/cost/realloc_cost.py (its own
// file: the rest of the core only calls realloc_time).
#include "search_core.hpp"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>
#include <vector>

namespace realign_core {

namespace {

// Python's a // b for b > 0 (rounds towards minus infinity, unlike C++'s a / b).
i64 floordiv(i64 a, i64 b) {
    i64 q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

// Byte counts are converted to double as Python does for int / int and
// int / float; the conversion is exact (hence identical) below 2**53.
constexpr i64 kExactDoubleLimit = i64{1} << 53;

// planner.cost.realloc_cost._tp_overlap
i64 tp_overlap(i64 i, i64 tp_d, i64 k, i64 tp_s) {
    const i64 lo = std::max(i * tp_s, k * tp_d);
    const i64 hi = std::min((i + 1) * tp_s, (k + 1) * tp_d);
    return hi > lo ? hi - lo : 0;
}

// A list of at most two pipeline stages (what _stages_holding returns).
struct Stages {
    std::array<i64, 2> s{};
    int n = 0;

    static Stages one(i64 a) { Stages r; r.s[0] = a; r.n = 1; return r; }
    bool contains(i64 j) const {
        for (int q = 0; q < n; ++q)
            if (s[q] == j) return true;
        return false;
    }
};

// planner.cost.realloc_cost._stages_holding("embedding", ...)
Stages embedding_stages(const ReallocModel& m, i64 pp) {
    Stages r = Stages::one(0);
    if (m.head_kind == kHeadLmTied && pp > 1) {
        r.s[1] = pp - 1;
        r.n = 2;
    }
    return r;
}

// planner.cost.realloc_cost._Acc: per-GPU received and sent bytes (0: intra, 1: inter).
// Indexed by GPU; a GPU never charged holds zeros, which change neither the sum
// nor the max that realloc_time takes over the Python dicts.
// _Acc.far: the bytes per holder of a slice group (stages, tp rank, EP rank) that reached
// GPUs on other nodes, in the order the groups first appear.
struct FarGroup {
    Stages stages;
    i64 k;
    i64 e;
    double per_holder;
};

struct Acc {
    std::vector<std::array<i64, 2>> recv;
    std::vector<std::array<double, 2>> send;
    std::vector<i64> local;    // bytes a destination GPU copies locally
    std::vector<i64> holders;  // scratch for _holders
    std::vector<FarGroup> far;
    // group (stages, k, e) -> its index in far (-1: none yet): slot
    // (row * (tp + 1) + k + 1) * (ep + 1) + e + 1, row j for one stage j, pp for the tied
    // embedding's two stages
    std::vector<i64> far_slot;
    i64 src_tp = 1;
    i64 src_ep = 1;

    Acc(i64 n_gpus, i64 tp, i64 pp, i64 ep)
        : recv(n_gpus, {0, 0}), send(n_gpus, {0.0, 0.0}), local(n_gpus, 0),
          far_slot((pp + 1) * (tp + 1) * (ep + 1), -1), src_tp(tp), src_ep(ep) {}

    i64& slot(const Stages& stages, i64 k, i64 e, i64 pp) {
        const i64 row = stages.n == 1 ? stages.s[0] : pp;
        return far_slot[(row * (src_tp + 1) + k + 1) * (src_ep + 1) + e + 1];
    }
};

// planner.cost.realloc_cost._holders: source GPUs at tp rank k (k < 0: any) of stages, of
// EP rank e (e < 0: any; else the dp ranks d with d % ep == e).
void holders_of(const Place& src, const Stages& stages, i64 k, i64 e, std::vector<i64>& out) {
    out.clear();
    const i64 d_lo = e < 0 ? 0 : e;
    const i64 d_step = e < 0 ? 1 : src.ep;
    for (int q = 0; q < stages.n; ++q) {
        const i64 j = stages.s[q];
        const i64 k_lo = k < 0 ? 0 : k;
        const i64 k_hi = k < 0 ? src.tp : k + 1;
        for (i64 kk = k_lo; kk < k_hi; ++kk)
            for (i64 d = d_lo; d < src.dp; d += d_step)
                out.push_back(src.first_gpu + kk + src.tp * (d + src.dp * j));
    }
}

// planner.cost.realloc_cost._charge: g receives nbytes of a slice of group (stages, k, e),
// shared evenly by the holders on its own node if any (each holder's send accumulated
// in charge order, as in Python), else by all holders (summed per group, added to them
// at the end). The holders are those of holders_of(src, stages, k, e): per stage an
// arithmetic progression, so the ones on g's node are found without visiting the rest.
void charge(Acc& acc, const Place& src, const Stages& stages, i64 k, i64 e, i64 g, i64 nbytes,
            i64 gpn) {
    if (nbytes >= kExactDoubleLimit) throw std::overflow_error("realloc_time: byte count >= 2**53");
    const i64 node_lo = g / gpn * gpn, node_hi = node_lo + gpn;
    // per stage: holders start + stride * q for q in [0, count)
    const i64 stride = k < 0 ? 1 : e < 0 ? src.tp : src.tp * src.ep;
    const i64 count = k < 0 ? src.tp * src.dp : e < 0 ? src.dp : src.dp / src.ep;
    i64 n_near = 0;
    std::array<std::array<i64, 3>, 2> near{};   // per stage: start, first q, end q
    for (int q = 0; q < stages.n; ++q) {
        const i64 start = src.first_gpu + (k < 0 ? 0 : k) + (e < 0 ? 0 : src.tp * e) +
                          src.tp * src.dp * stages.s[q];
        // q with node_lo <= start + stride * q < node_hi
        const i64 q_lo = std::max<i64>(0, node_lo <= start ? 0 : (node_lo - start + stride - 1) / stride);
        const i64 q_hi = std::min<i64>(count, node_hi <= start ? 0 : (node_hi - start + stride - 1) / stride);
        near[q] = {start, q_lo, std::max(q_lo, q_hi)};
        n_near += near[q][2] - near[q][1];
    }
    if (count * stages.n == 0) throw std::logic_error("realloc_time: a slice has no holder");
    if (n_near > 0) {
        acc.recv[g][0] += nbytes;
        const double share = static_cast<double>(nbytes) / static_cast<double>(n_near);
        for (int q = 0; q < stages.n; ++q)
            for (i64 t = near[q][1]; t < near[q][2]; ++t)
                acc.send[near[q][0] + stride * t][0] += share;
        return;
    }
    acc.recv[g][1] += nbytes;
    const double per_holder = static_cast<double>(nbytes) / static_cast<double>(count * stages.n);
    i64& at = acc.slot(stages, k, e, src.pp);
    if (at >= 0) {
        acc.far[at].per_holder += per_holder;
        return;
    }
    at = static_cast<i64>(acc.far.size());
    acc.far.push_back({stages, k, e, per_holder});
}

// The per-destination-GPU context of realloc_recv_send's closures.
struct DstGpu {
    i64 g;      // global GPU
    i64 i;      // its tp rank in dst
    i64 e;      // its EP rank in dst
    bool local; // it also belongs to the source mesh
    i64 k_g;    // its tp rank in src (local only)
    i64 j_g;    // its pp stage in src (local only)
    i64 e_g;    // its EP rank in src (local only)
};

// realloc_recv_send's nested sharded(): a TP-split tensor held by `stages`.
void sharded(Acc& acc, const Place& src, const Place& dst, const DstGpu& d, i64 nbytes,
             const Stages& stages, i64 gpn) {
    const i64 unit = dst.tp * src.tp;
    for (i64 k = 0; k < src.tp; ++k) {
        const i64 ov = tp_overlap(d.i, dst.tp, k, src.tp);
        if (ov == 0) continue;
        if (d.local && d.k_g == k && stages.contains(d.j_g)) {
            acc.local[d.g] += nbytes * ov / unit;
            continue;
        }
        charge(acc, src, stages, k, -1, d.g, nbytes * ov / unit, gpn);
    }
}

// realloc_recv_send's nested experts(): TP shard i of EP rank e's experts, per source
// (tp rank, EP rank) overlap.
void experts(Acc& acc, const Place& src, const Place& dst, const DstGpu& d, i64 nbytes,
             const Stages& stages, i64 gpn) {
    const i64 unit = dst.tp * src.tp;
    for (i64 k = 0; k < src.tp; ++k) {
        const i64 ov = tp_overlap(d.i, dst.tp, k, src.tp);
        if (ov == 0) continue;
        for (i64 es = 0; es < src.ep; ++es) {
            const i64 oe = tp_overlap(d.e, dst.ep, es, src.ep);
            if (oe == 0) continue;
            const i64 part = nbytes * oe / (dst.ep * src.ep) * ov / unit;
            if (d.local && d.k_g == k && d.e_g == es && stages.contains(d.j_g)) {
                acc.local[d.g] += part;
                continue;
            }
            charge(acc, src, stages, k, es, d.g, part, gpn);
        }
    }
}

// realloc_recv_send's nested replicated(): a tensor every tp rank of `stages` holds.
void replicated(Acc& acc, const Place& src, const DstGpu& d, i64 nbytes, const Stages& stages,
                i64 gpn) {
    if (d.local && stages.contains(d.j_g)) {
        acc.local[d.g] += nbytes;
        return;
    }
    charge(acc, src, stages, -1, -1, d.g, nbytes, gpn);
}

// planner.cost.realloc_cost.realloc_recv_send
void realloc_recv_send(Acc& acc, const ReallocModel& m, const Place& src, const Place& dst,
                       i64 gpn) {
    const i64 L = m.n_layers;
    const i64 per_s = L / src.pp;
    if (per_s == 0) throw std::domain_error("realloc_time: source pp exceeds n_layers");
    const i64 per_d = L / dst.pp;
    for (i64 r = 0; r < dst.n_gpus; ++r) {
        DstGpu d;
        d.g = dst.first_gpu + r;
        d.i = r % dst.tp;
        d.e = r / dst.tp % dst.dp % dst.ep;
        const i64 j = r / (dst.tp * dst.dp);
        d.local = src.first_gpu <= d.g && d.g < src.first_gpu + src.n_gpus;
        d.k_g = d.local ? (d.g - src.first_gpu) % src.tp : -1;
        d.j_g = d.local ? (d.g - src.first_gpu) / (src.tp * src.dp) : -1;
        d.e_g = d.local ? (d.g - src.first_gpu) / src.tp % src.dp % src.ep : -1;

        if (j == 0) sharded(acc, src, dst, d, m.embedding_bytes, embedding_stages(m, src.pp), gpn);
        const i64 d_lo = j * per_d, d_hi = (j + 1) * per_d;
        for (i64 js = d_lo / per_s; js < floordiv(d_hi - 1, per_s) + 1; ++js) {
            const i64 lo = std::max(d_lo, js * per_s), hi = std::min(d_hi, (js + 1) * per_s);
            const i64 n_dense = m.dense_in(lo, hi);
            const i64 c = hi - lo - n_dense;  // sparse layers (every layer of a dense model)
            sharded(acc, src, dst, d,
                    m.layer_sharded_bytes * c + m.dense_layer_sharded_bytes * n_dense,
                    Stages::one(js), gpn);
            if (m.layer_expert_bytes != 0 && c != 0)
                experts(acc, src, dst, d, m.layer_expert_bytes * c, Stages::one(js), gpn);
            replicated(acc, src, d,
                       m.layer_replicated_bytes * c + m.dense_layer_replicated_bytes * n_dense,
                       Stages::one(js), gpn);
        }
        if (j == dst.pp - 1) {
            const Stages last = Stages::one(src.pp - 1);
            replicated(acc, src, d, m.final_norm_bytes, last, gpn);
            if (m.head_kind == kHeadLmUntied)
                sharded(acc, src, dst, d, m.head_bytes, last, gpn);
            else if (m.head_kind == kHeadValue)
                replicated(acc, src, d, m.head_bytes, last, gpn);
            else if (dst.pp > 1)
                sharded(acc, src, dst, d, m.embedding_bytes, embedding_stages(m, src.pp), gpn);
        }
    }
    for (const FarGroup& f : acc.far) {
        holders_of(src, f.stages, f.k, f.e, acc.holders);
        for (i64 h : acc.holders) acc.send[h][1] += f.per_holder;
    }
}

}  // namespace

// planner.cost.realloc_cost.realloc_time
ReallocCost realloc_time(const ReallocModel& m, const Place& src, const Place& dst,
                         const Links& links) {
    const i64 n = std::max(src.first_gpu + src.n_gpus, dst.first_gpu + dst.n_gpus);
    Acc acc(n, src.tp, src.pp, src.ep);
    realloc_recv_send(acc, m, src, dst, links.gpus_per_node);
    double worst = 0.0;
    i64 total = 0;
    bool any_inter = false;
    for (i64 g = 0; g < n; ++g) {
        const i64 a = acc.recv[g][0], b = acc.recv[g][1], c = acc.local[g];
        total += a + b;
        any_inter = any_inter || b > 0;
        worst = std::max(worst, static_cast<double>(a) / links.intra_bytes_per_s +
                                    static_cast<double>(b) / links.inter_bytes_per_s +
                                    static_cast<double>(a + b + c) / links.copy_bytes_per_s);
    }
    for (i64 h = 0; h < n; ++h) {
        const double a = acc.send[h][0], b = acc.send[h][1];
        worst = std::max(worst, a / links.intra_bytes_per_s + b / links.inter_bytes_per_s);
    }
    double lat = 0.0;
    if (total > 0) lat = any_inter ? links.inter_latency_s : links.intra_latency_s;
    return {links.fixed_s + worst + lat, total};
}

}  // namespace realign_core
