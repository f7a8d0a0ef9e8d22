"""Files in and out: heads folders (:mod:`.checkpoint`), Medusa-2 adapters (:mod:`.adapter`), vLLM and
FasterDecoding formats (:mod:`.interop`), the speculators eagle3 format of the eagle drafter (:mod:`.speculators`),
the reference model (:mod:`.prepare`), atomic writes (:mod:`.files`)."""
