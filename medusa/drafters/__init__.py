"""Drafters: what proposes each decode step's candidate tree (:mod:`medusa.drafters.base` is the interface).

Registered: ``heads`` (Medusa and Hydra heads, :mod:`medusa.draft`), ``lookup`` (prompt lookup,
:mod:`medusa.prompt_lookup`), ``composite`` (several in one tree) and ``none`` (plain decoding),
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

__all__ = ["DraftSampler", "DraftTree", "Drafter", "Draws", "SampleWithoutReplacement", "TopK", "drafter_class",
           "drafter_names", "register_drafter"]
