"""Memory mechanics, below the engine and shared by the tiers, the server and the SDK.

- ``kvstore.memory.slab``: ``SlabAllocator``, offsets into one preallocated arena.
- ``kvstore.memory.shm``: the shm arena's file layout, slot handles and ``ShmReader``
  (the seqlock read a co-located client does without the server).
- ``kvstore.memory.buffers``: ``Scratch`` (a per-thread reused buffer) and
  ``BufferPool`` (buffers lent out and given back).
- ``kvstore.memory.halves``: large copies in two halves, the second on a helper thread.

Nothing here imports the store, the tiers, the server or the SDK.
"""
