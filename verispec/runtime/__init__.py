"""Running a model over a paged KV cache: the block manager, prefix hashing, the model runner.

The engine runs its target with these, and a drafter that runs a model of its own (a draft
model, EAGLE's head) runs it with the same pieces over a cache of its own; they sit on a floor
below both so that neither imports the other for them.
"""
