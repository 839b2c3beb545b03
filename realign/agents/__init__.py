"""Multi-turn rollouts: environments, tools and the loop that talks to them
(docs/tools.md). A user writes an :class:`~realign.agents.interface.Environment`
(``reset``/``step``) or plain tool functions and names them in the YAML."""
from realign.agents.interface import Environment, Episode, Step, Tool

__all__ = ["Environment", "Episode", "Step", "Tool"]
