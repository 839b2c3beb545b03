"""What a call and a reallocation cost: the cost model's settings, rates (from a
profile table or the device preset), per-stage engine terms, time and memory of an MFC
under an allocation, reallocation slices and their cost, and the spread of a step."""
