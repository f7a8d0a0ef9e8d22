"""Drafters: what proposes each decode step's candidate tree (:mod:`medusa.drafters.base` is the interface).

Registered: ``heads`` (Medusa and Hydra heads, :mod:`medusa.drafters.heads_drafter`), ``lookup`` (prompt lookup,
:mod:`medusa.drafters.prompt_lookup`), ``composite`` (several in one tree) and ``none`` (plain decoding),
:mod:`medusa.drafters.composite`.
"""

from medusa.drafters.base import (
    Drafter,
    DraftSampler,
    DraftTree,
    Draws,
    SampleWithoutReplacement,
    TopK,
    drafter_class,
    drafter_names,
    register_drafter,
)
from medusa.drafters.composite import CompositeDrafter, NoDrafter, tree_drafter
from medusa.drafters.per_step import PerStepDrafter, StepCost

# The eagle head type builds on medusa.drafters.heads; importing it here (every import of a drafters module runs this
# file first) registers it wherever heads are built, without heads.py importing it back.
from medusa.drafters import eagle  # noqa: E402, F401  isort: skip

__all__ = ["CompositeDrafter", "DraftSampler", "DraftTree", "Drafter", "Draws", "NoDrafter", "PerStepDrafter",
           "SampleWithoutReplacement", "StepCost", "TopK", "drafter_class", "drafter_names", "register_drafter",
           "tree_drafter"]
