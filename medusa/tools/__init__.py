"""Measuring and choosing: the bench (:mod:`.bench`, :mod:`.report`), tree calibration (:mod:`.calibrate`),
Medusa-2 drift (:mod:`.drift`) and pictures (:mod:`.plots`)."""
