"""The lean update: the optimizers the fast paths know (:mod:`.optimizers`), the dispatch chosen once per optimizer
(:mod:`.update`), and the paths it chooses among: the one-pass update by its step plan (:mod:`.plan`), the chunked
update with torch's own fused or foreach function (:mod:`.chunked`) and any other optimizer on fp32 slices
(:mod:`.generic`)."""
