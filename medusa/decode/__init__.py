"""Decoding: the candidate tree (:mod:`.tree`), acceptance (:mod:`.greedy`, :mod:`.acceptance`), the generation loop
(:mod:`.loop`), batched decoding (:mod:`.batch`) and the base's generation settings (:mod:`.logits_process`)."""
