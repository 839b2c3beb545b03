"""``realign profile``: measure, on this machine, what the cost model's terms need, and
write the versioned profile table (:class:`planner.cost.profile.ProfileTable`)."""
