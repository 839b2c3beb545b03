"""Rule-based rewards: the built-in math verifier and user reward functions loaded by
``"module:function"`` (:mod:`realign.rewards.registry`). Pure Python, no torch."""
