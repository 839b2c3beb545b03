// An open-addressing hash table from 64-bit keys to values: one flat array probed
// linearly, a power-of-two size kept at most half full. The reallocation cache looks a
// pair of placements up on every simulated plan; std::unordered_map's node per entry
// and its modulo were most of a lookup.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace realign_core {

template <class V>
class FlatTable {
public:
    // the value at `key`, or null
    const V* find(std::uint64_t key) const {
        if (slots_.empty()) return nullptr;
        for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
            const Slot& s = slots_[i];
            if (!s.used) return nullptr;
            if (s.key == key) return &s.value;
        }
    }
    // `value` at `key` (a key not yet held)
    void insert(std::uint64_t key, const V& value) {
        if (2 * (size_ + 1) > slots_.size()) grow();
        place(key, value);
        ++size_;
    }
    std::size_t size() const { return size_; }

private:
    struct Slot {
        std::uint64_t key = 0;
        V value{};
        bool used = false;
    };
    // a multiplicative (Fibonacci) hash: keys are small indexes, close together
    std::size_t slot(std::uint64_t key) const {
        return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ULL) >> shift_) & mask_;
    }
    void place(std::uint64_t key, const V& value) {
        std::size_t i = slot(key);
        while (slots_[i].used) i = (i + 1) & mask_;
        slots_[i].key = key;
        slots_[i].value = value;
        slots_[i].used = true;
    }
    void grow() {
        std::vector<Slot> old;
        old.swap(slots_);
        const std::size_t n = old.empty() ? 64 : 2 * old.size();
        slots_.assign(n, Slot{});
        mask_ = n - 1;
        int bits = 0;
        while ((std::size_t{1} << bits) < n) ++bits;
        shift_ = 64 - bits;
        for (const Slot& s : old)
            if (s.used) place(s.key, s.value);
    }

    std::vector<Slot> slots_;
    std::size_t size_ = 0;
    std::size_t mask_ = 0;
    int shift_ = 64;
};

}  // namespace realign_core
