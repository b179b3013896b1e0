# EXPERIMENT (tools/warpgroup_multi.py): decode_multi's stage 1 as one warpgroup, k4v4-d128-planes.
# Executed by tools/warpgroup_multi.py in a namespace holding gl, gluon, warpgroup_mma, fence_async_shared and the
# rendered module's helpers and layout constants (_mma_key_magnitudes, _PAGE_SIZE, ...).


@gluon.jit
def _wg_row_groups(x):
    """[64, BLOCK_H] in the wgmma accumulator's layout -> [4, 8, BLOCK_H]: the two rows of each lane (r and r + 8)
    summed, the warps' (rows 16w..) and lanes' (lane // 4) kept apart, so that nothing crosses a lane."""
    return gl.sum(gl.reshape(x, [x.shape[0] // 16, 2, 8, x.shape[1]]), axis=1)


@gluon.jit
def _wg_token_pairs(even, odd):
    """int16 units of tokens 2q and 2q + 1 -> int32 holding them in its low and high halves. Kept 16 bits wide, the
    pairs that ldmatrix loaded together need no widening and repacking (ptxas folds the unpack and pack)."""
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [even, odd], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _wg_pair_codes(low):
    """Token pairs of 16-bit value units (_wg_token_pairs: token 2q's in the low half) -> [..., 2, 2, 2] fp16: element
    (s, r, e) is code r + 2s of the unit of token 2q + e, as the fp16 subnormal code * 2**-24 (r = 0) or * 2**-20
    (r = 1)."""
    codes0 = low & 0x000F000F
    codes1 = low & 0x00F000F0
    codes2 = (low >> 8) & 0x000F000F
    codes3 = (low >> 8) & 0x00F000F0
    # gl.join adds a last dim (join(a, b)[..., 1] is b): code 2s + r at [s, r].
    pairs = gl.join(gl.join(codes0, codes2), gl.join(codes1, codes3))
    first, second = _fp16_halves(pairs)
    return gl.join(first, second)


@gluon.jit
def _wg_value_codes(even, odd):
    """16-bit value units (4 codes each) of tokens 2q and 2q + 1, in int32 -> [..., 2, 2, 2] fp16: element (s, r, e)
    is code r + 2s of the unit of token 2q + e, as the fp16 subnormal code * 2**-24 (r = 0) or * 2**-20 (r = 1)."""
    return _wg_pair_codes(_byte_perm(even, odd, 0x5410))  # halves: bytes 0, 1 of each token's unit


@gluon.jit
def _wg_columns_max(scores, warp_maxes, WARP_MAXES: gl.constexpr):
    """The max of each column of scores [64, BLOCK_H] across the 4 warps, in the accumulator's column layout: each
    warp's (rows 16w..16w + 15) through shared memory, one barrier. The caller orders earlier reads of warp_maxes
    before this store (a barrier of its own: the next tile's store comes after the one that publishes P)."""
    warp_maxes.store(gl.max(gl.reshape(scores, [4, scores.shape[0] // 4, scores.shape[1]]), axis=1))
    _cta_barrier()
    return gl.convert_layout(gl.max(warp_maxes.load(WARP_MAXES), axis=0), gl.SliceLayout(0, scores.type.layout))


@gluon.jit
def _wg_load_tile(tile_start, page_in_tile, own_page, value_unit, key_word, cache_ptr, table_row, max_blocks_per_seq,
                  num_blocks, stride_cache_block, head_offset, TILE_POSITIONS: gl.constexpr,
                  KEY_TILE: gl.constexpr, VALUE_TILE: gl.constexpr):
    """Issue the loads of the tile at tile_start (a block id outside the cache reads block 0; its tokens are masked
    later): (whether each page's block is inside the cache, the pages' byte offsets, every lane holding every page;
    the key words [pages, positions, 16], warp w page w; the value units [pages, positions, 32]; the key norms and
    value scale-zeros [pages, positions])."""
    page_ok, tile_pages = _mma_tile_pages(tile_start, page_in_tile, table_row, max_blocks_per_seq, num_blocks,
                                          stride_cache_block, head_offset)
    # Warp w's own page as well (a second read of the block table, from L1): converting tile_pages would go through
    # shared memory, as a register cannot be picked by the warp's index.
    page_base = _mma_tile_pages(tile_start, own_page, table_row, max_blocks_per_seq, num_blocks, stride_cache_block,
                                head_offset)[1]
    position = gl.arange(0, TILE_POSITIONS, layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_TILE)))
    value_offset = (position * (_VALUE_CODE_BYTES // 2))[None, :, None] + value_unit[None, None, :]
    value_units = (cache_ptr + tile_pages + _VALUE_CODE_PLANE).to(gl.pointer_type(gl.uint16))
    units = gl.load(value_units[:, None, None] + value_offset)
    position = gl.arange(0, TILE_POSITIONS, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_TILE)))
    key_offset = (position * (_KEY_CODE_BYTES // 4))[None, :, None] + key_word[None, None, :]
    words = gl.load((cache_ptr + page_base).to(gl.pointer_type(gl.int32))[:, None, None] + key_offset)
    TOKENS: gl.constexpr = gl.SliceLayout(2, KEY_TILE)
    position = gl.arange(0, TILE_POSITIONS, layout=gl.SliceLayout(0, TOKENS))
    token_base = gl.convert_layout(page_base, gl.SliceLayout(1, TOKENS))[:, None]
    key_norm = gl.load((cache_ptr + token_base + _KEY_NORM_PLANE).to(gl.pointer_type(gl.float16)) + position[None, :])
    scale_zero = gl.load((cache_ptr + token_base + _VALUE_SCALE_PLANE).to(gl.pointer_type(gl.int32))
                         + position[None, :])
    return page_ok, words, units, key_norm, scale_zero


@gluon.jit
def _wg_copy_tile(tile_start, slot, key_ring, value_ring, norm_ring, scale_ring, cache_ptr, table_row,
                  max_blocks_per_seq, num_blocks, stride_cache_block, head_offset, KEY_COPY: gl.constexpr,
                  VALUE_COPY: gl.constexpr, NORM_COPY: gl.constexpr, SCALE_COPY: gl.constexpr):
    """cp.async of the tile at tile_start into ring slot `slot`: warp w copies page w's key words, value units, key
    norms and value scale-zeros (a block id outside the cache copies block 0; its tokens are masked later)."""
    page = gl.arange(0, key_ring.shape[1], layout=gl.SliceLayout(1, gl.SliceLayout(2, KEY_COPY)))
    page_base = _mma_tile_pages(tile_start, page, table_row, max_blocks_per_seq, num_blocks, stride_cache_block,
                                head_offset)[1]
    position = gl.arange(0, key_ring.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_COPY)))
    word = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, KEY_COPY)))
    offsets = (position * (_KEY_CODE_BYTES // 4))[None, :, None] + word[None, None, :]
    _async_load(key_ring.index(slot), (cache_ptr + page_base).to(gl.pointer_type(gl.int32))[:, None, None] + offsets)
    value_page = gl.convert_layout(page_base, gl.SliceLayout(1, gl.SliceLayout(2, VALUE_COPY)))
    position = gl.arange(0, key_ring.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_COPY)))
    unit = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, VALUE_COPY)))
    offsets = (position * (_VALUE_CODE_BYTES // 2))[None, :, None] + unit[None, None, :]
    units = (cache_ptr + value_page + _VALUE_CODE_PLANE).to(gl.pointer_type(gl.int16))
    _async_load(value_ring.index(slot), units[:, None, None] + offsets)
    norm_page = gl.convert_layout(page_base, gl.SliceLayout(1, NORM_COPY))
    position = gl.arange(0, key_ring.shape[2], layout=gl.SliceLayout(0, NORM_COPY))
    norms = (cache_ptr + norm_page + _KEY_NORM_PLANE).to(gl.pointer_type(gl.float16))
    _async_load(norm_ring.index(slot), norms[:, None] + position[None, :])
    scale_page = gl.convert_layout(page_base, gl.SliceLayout(1, SCALE_COPY))
    position = gl.arange(0, key_ring.shape[2], layout=gl.SliceLayout(0, SCALE_COPY))
    scales = (cache_ptr + scale_page + _VALUE_SCALE_PLANE).to(gl.pointer_type(gl.int32))
    _async_load(scale_ring.index(slot), scales[:, None] + position[None, :])


@gluon.jit
def tq_decode_multi_stage1_wg(
    query_ptr,  # [batch * Q_LEN, num_q_heads, 128] fp16: query @ rotation * scale * log2(e), tq_prepare_query's
    cache_ptr,  # uint8 [num_blocks, num_kv_heads, page bytes] (planes)
    block_table_ptr,  # int32 [batch, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [batch]
    centroids_ptr,  # fp32 [16], the default (symmetric) codebook
    partial_out_ptr,  # fp32 [batch * Q_LEN, num_q_heads, split_capacity, 128]
    partial_lse_ptr,  # fp32 [batch * Q_LEN, num_q_heads, split_capacity]
    num_q_heads,
    num_blocks,
    max_blocks_per_seq,
    num_splits,
    split_capacity,
    stride_query_batch,
    stride_query_token,
    stride_query_head,
    stride_cache_block,
    stride_cache_head,
    stride_table_batch,
    GROUP_SIZE: gl.constexpr,  # query heads per KV head
    Q_LEN: gl.constexpr,  # query tokens per sequence, all of them in this program's columns
    BLOCK_H: gl.constexpr,  # Q_LEN * GROUP_SIZE rounded up to a power of two >= 16: the wgmma N
    BLOCK_KV: gl.constexpr,  # 64: tokens per tile, 16 per warp
    TILE_PAGES: gl.constexpr,
    TILE_POSITIONS: gl.constexpr,
    KEY_TILE: gl.constexpr,  # tile_layouts(): [pages, positions, 16 words]
    VALUE_TILE: gl.constexpr,  # [pages, positions, 32 16-bit units]
    WARP_MAXES: gl.constexpr,  # [4, BLOCK_H]: the 4 warps' maxes of each column in every lane holding the column
    PREFETCH: gl.constexpr,  # issue the next tile's loads before decoding this one (registers as the ring)
    STAGES: gl.constexpr,  # >= 3: a cp.async ring of STAGES tiles in shared memory (PREFETCH unused); else loads
    COPIES: gl.constexpr,  # the ring's copy layouts (key words, value units, key norms, scale-zeros)
    FLAG_TEST: gl.constexpr,  # the lazy max test as a flag per warp (exact max only where it moves); 16-bit pairs
):
    gl.static_assert(TILE_POSITIONS == _PAGE_SIZE, "64-token tiles of whole pages")
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    OPERAND_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    SWIZZLE: gl.constexpr = 128 if BLOCK_H * 2 >= 128 else BLOCK_H * 2
    OPERAND_B: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE, element_bitwidth=16, rank=2)
    QUERY_LOADS: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1])

    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.minimum(gl.load(seq_lens_ptr + seq), max_blocks_per_seq * _PAGE_SIZE)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_KV) * BLOCK_KV
    split_start = split * split_len
    split_end = gl.minimum(split_start + split_len, seq_len)
    passed_len = gl.load(seq_lens_ptr + seq)
    split_end = gl.minimum(split_end, passed_len)  # the last query token's limit
    table_row = block_table_ptr + seq.to(gl.int64) * stride_table_batch
    head_offset = kv_head.to(gl.int64) * stride_cache_head

    # Q^T [128 head dims, BLOCK_H columns] in shared memory (wgmma's B operand): row m holds head dim
    # _mma_query_dim(m), the order in which each lane's key registers hold the head dims; column c is query token
    # c // GROUP_SIZE, head c % GROUP_SIZE.
    query_row = gl.arange(0, 128, layout=gl.SliceLayout(1, QUERY_LOADS))
    column = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, QUERY_LOADS))
    column_ok = column < Q_LEN * GROUP_SIZE
    query_heads = (seq.to(gl.int64) * stride_query_batch + (column // GROUP_SIZE) * stride_query_token
                   + (kv_head * GROUP_SIZE + column % GROUP_SIZE) * stride_query_head)
    query = gl.load(query_ptr + query_heads[None, :] + _mma_query_dim(query_row)[:, None], mask=column_ok[None, :],
                    other=0.0)
    query_t = gl.allocate_shared_memory(gl.float16, [128, BLOCK_H], OPERAND_B, query)
    probabilities = gl.allocate_shared_memory(gl.float16, [BLOCK_KV, BLOCK_H], OPERAND_B)
    warp_maxes = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    warp_flags = gl.allocate_shared_memory(gl.int32, [4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ALL_FLAGS: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])  # every thread reads the 4 warps' flags
    if STAGES > 1:
        gl.static_assert(STAGES >= 3, "the ring waits for tile t + 1 while tile t + 2 may be in flight")
        key_ring = gl.allocate_shared_memory(gl.int32, [STAGES, TILE_PAGES, TILE_POSITIONS, 16], _RING_PLANE)
        value_ring = gl.allocate_shared_memory(gl.int16, [STAGES, TILE_PAGES, TILE_POSITIONS, 32], _RING_PLANE)
        norm_ring = gl.allocate_shared_memory(gl.float16, [STAGES, TILE_PAGES, TILE_POSITIONS], _RING_TOKENS)
        scale_ring = gl.allocate_shared_memory(gl.int32, [STAGES, TILE_PAGES, TILE_POSITIONS], _RING_TOKENS)
        for stage in gl.static_range(STAGES - 1):
            if split_start + stage * BLOCK_KV < split_end:
                _wg_copy_tile(split_start + stage * BLOCK_KV, stage, key_ring, value_ring, norm_ring, scale_ring,
                              cache_ptr, table_row, max_blocks_per_seq, num_blocks, stride_cache_block, head_offset,
                              gl.constexpr(COPIES[0]), gl.constexpr(COPIES[1]), gl.constexpr(COPIES[2]),
                              gl.constexpr(COPIES[3]))
            async_copy.commit_group()
        # Tile 0 copied, by every thread: the barrier below makes it visible to all. Every later tile t + 1 is
        # waited for before the barrier that publishes tile t's P.
        async_copy.wait_group(STAGES - 2)
    slot = split_start * 0
    fence_async_shared()
    _cta_barrier()  # Q^T whole before the first MMA (else the compiler puts a barrier before every tile's)

    entry = gl.arange(0, 8, layout=_WG_CODEBOOK)
    centroids = gl.load(centroids_ptr + 8 + entry)
    codebook = _build_byte_table(centroids.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF, entry)

    KEY_PAGES: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, KEY_TILE))
    KEY_WORDS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, KEY_TILE))
    VALUE_PAGES: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, VALUE_TILE))
    VALUE_UNITS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, VALUE_TILE))
    TOKENS: gl.constexpr = gl.SliceLayout(2, KEY_TILE)
    TOKEN_ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    # The tile's pages in every lane of every warp (the value tile's page dim): each warp's own page, and the
    # whole tile's validity, then follow without crossing warps.
    page_in_tile = gl.arange(0, TILE_PAGES, layout=VALUE_PAGES)
    own_page = gl.arange(0, TILE_PAGES, layout=KEY_PAGES)
    key_word = gl.arange(0, 16, layout=KEY_WORDS)
    value_unit = gl.arange(0, 32, layout=VALUE_UNITS)

    running_max = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC))
    visible_end = passed_len - Q_LEN + 1 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, ACC)) // GROUP_SIZE
    seen_whole_end = gl.minimum(split_end, passed_len - Q_LEN + 1)
    lane_sum = _wg_row_groups(gl.zeros([BLOCK_KV, BLOCK_H], gl.float32, layout=ACC))
    lane_zero_sum = lane_sum
    acc = gl.zeros([128, BLOCK_H], gl.float32, layout=ACC)

    arguments = (page_in_tile, own_page, value_unit, key_word, cache_ptr, table_row, max_blocks_per_seq, num_blocks,
                 stride_cache_block, head_offset)
    if PREFETCH:
        next_tile = _wg_load_tile(split_start, *arguments, TILE_POSITIONS, KEY_TILE, VALUE_TILE)
    for tile_start in range(split_start, split_end, BLOCK_KV):
        if STAGES > 1:
            page_ok = _mma_tile_pages(tile_start, page_in_tile, table_row, max_blocks_per_seq, num_blocks,
                                      stride_cache_block, head_offset)[0]
            words = key_ring.index(slot).load(KEY_TILE)
            key_norm = norm_ring.index(slot).load(TOKENS)
            scale_zero = scale_ring.index(slot).load(TOKENS)
        elif PREFETCH:
            page_ok, words, units, key_norm, scale_zero = next_tile
            # The next tile's loads (past the split's end: the block table's next entries, or block 0), in flight
            # while this one is decoded.
            next_tile = _wg_load_tile(tile_start + BLOCK_KV, *arguments, TILE_POSITIONS, KEY_TILE, VALUE_TILE)
        else:
            page_ok, words, units, key_norm, scale_zero = _wg_load_tile(tile_start, *arguments, TILE_POSITIONS,
                                                                        KEY_TILE, VALUE_TILE)

        # --- scores^T [64, BLOCK_H]: warp w decodes the keys of page w of the tile
        keys = _mma_key_magnitudes(words, codebook)  # [pages, positions, 16, 4, 2]
        keys = gl.reshape(keys, [BLOCK_KV, 4, 4, 4, 2])
        keys = gl.convert_layout(gl.reshape(gl.permute(keys, [0, 2, 3, 1, 4]), [BLOCK_KV, 128]), OPERAND_A)
        scores = warpgroup_mma(keys, query_t, gl.zeros([BLOCK_KV, BLOCK_H], gl.float32, layout=ACC))

        key_norm = gl.convert_layout(gl.reshape(key_norm, [BLOCK_KV]), TOKEN_ROWS).to(gl.float32)
        scale_zero = gl.convert_layout(gl.reshape(scale_zero, [BLOCK_KV]), TOKEN_ROWS)
        scores = scores * key_norm[:, None]
        value_scale = (scale_zero & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        value_zero = (scale_zero >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        pages_ok = gl.min(page_ok.to(gl.int32), axis=0) != 0  # every lane holds every page's
        if (tile_start + BLOCK_KV > seen_whole_end) | (not pages_ok):
            tile_page = gl.arange(0, TILE_PAGES, layout=gl.SliceLayout(1, TOKENS))
            position = gl.arange(0, TILE_POSITIONS, layout=gl.SliceLayout(0, TOKENS))
            tokens = tile_start + tile_page[:, None] * TILE_POSITIONS + position[None, :]
            valid = gl.convert_layout(page_ok, gl.SliceLayout(1, TOKENS))[:, None] & (tokens < split_end)
            valid = gl.convert_layout(gl.reshape(valid, [BLOCK_KV]), TOKEN_ROWS)
            row_tokens = gl.convert_layout(gl.reshape(tokens, [BLOCK_KV]), TOKEN_ROWS)
            visible = valid[:, None] & (row_tokens[:, None] < visible_end[None, :])
            scores = gl.where(visible, scores, float("-inf"))
            value_scale = gl.where(valid, value_scale, 0.0)
            value_zero = gl.where(valid, value_zero, 0.0)

        if FLAG_TEST:
            # Online softmax with a lazy max, tested before it is taken: whether any score passes the running max
            # by more than _STALE_MAX_SLACK, a flag per warp through shared memory (one barrier); only where one
            # is up (a split's first tiles, mostly) the columns' exact max across the warps (a second barrier).
            passed = (scores > (running_max + _STALE_MAX_SLACK)[None, :]).to(gl.int32)
            warp_flags.store(gl.max(gl.reshape(passed, [4, BLOCK_KV // 4 * BLOCK_H]), axis=1))
            _cta_barrier()
            moves = gl.max(warp_flags.load(ALL_FLAGS), axis=0) != 0
        else:
            # Online softmax with a lazy max, the columns' max taken across the 4 warps every tile.
            tile_max = _wg_columns_max(scores, warp_maxes, WARP_MAXES)
            moves = gl.max((tile_max > running_max + _STALE_MAX_SLACK).to(gl.int32), axis=0) != 0
        if STAGES > 1:
            # Every warp is past tile t - 1 (its reads of the ring included): its slot takes tile t + STAGES - 1.
            ahead = tile_start + (STAGES - 1) * BLOCK_KV
            if ahead < split_end:
                _wg_copy_tile(ahead, gl.where(slot == 0, STAGES - 1, slot - 1), key_ring, value_ring, norm_ring,
                              scale_ring, cache_ptr, table_row, max_blocks_per_seq, num_blocks, stride_cache_block,
                              head_offset, gl.constexpr(COPIES[0]), gl.constexpr(COPIES[1]), gl.constexpr(COPIES[2]),
                              gl.constexpr(COPIES[3]))
            async_copy.commit_group()
        if moves:
            if FLAG_TEST:
                # The flags' barrier above ordered every earlier read of warp_maxes before this store.
                tile_max = _wg_columns_max(scores, warp_maxes, WARP_MAXES)
            new_max = gl.maximum(running_max, tile_max)
            rescale = gl.exp2(running_max - gl.where(new_max == float("-inf"), 0.0, new_max))
            running_max = new_max
            acc = acc * rescale[None, :]
            lane_rescale = gl.convert_layout(rescale, gl.SliceLayout(0, gl.SliceLayout(1, lane_sum.type.layout)))
            lane_sum = lane_sum * lane_rescale[None, None, :]
            lane_zero_sum = lane_zero_sum * lane_rescale[None, None, :]
        probs = gl.exp2(scores - gl.where(running_max == float("-inf"), 0.0, running_max)[None, :])
        lane_sum += _wg_row_groups(probs)
        lane_zero_sum += _wg_row_groups(probs * value_zero[:, None])
        # No barrier before the store: every warp passed the barrier of the cross-warp max above after its own
        # MMA of the previous tile (a synchronous wgmma) had read P.
        probabilities.store((probs * value_scale[:, None]).to(gl.float16))
        fence_async_shared()
        if STAGES > 1:
            # Tile t + 1 copied by this thread; the wait ends with a barrier of the CTA (triton's lowering), which
            # also publishes P.
            async_copy.wait_group(STAGES - 2)
        else:
            _cta_barrier()  # P whole before any warp's MMA reads it
        if STAGES > 1:
            units = value_ring.index(slot).load(VALUE_TILE)  # visible since the previous tile's barrier


        # --- out^T [128, BLOCK_H] += V^T P^T: lane 4g + t of warp w holds 16-bit unit 8w + g of its tokens
        if FLAG_TEST:
            even, odd = gl.split(gl.permute(gl.reshape(units.to(gl.int16, bitcast=True), [BLOCK_KV // 2, 2, 32]),
                                            [0, 2, 1]))
            values = _wg_pair_codes(_wg_token_pairs(even, odd))  # [BLOCK_KV // 2, 32 units, 2 (s), 2 (r), 2 (e)]
        else:
            even, odd = gl.split(gl.permute(gl.reshape(units.to(gl.int32), [BLOCK_KV // 2, 2, 32]), [0, 2, 1]))
            values = _wg_value_codes(even, odd)  # [BLOCK_KV // 2, 32 units, 2 (s), 2 (r), 2 (e)]
        # Unit 8w + g, code r + 2s to row 64s + 16w + 8r + g; token 2q + e to column 2q + e.
        values = gl.reshape(values, [BLOCK_KV // 2, 4, 8, 2, 2, 2])
        values = gl.reshape(gl.permute(values, [3, 1, 4, 2, 0, 5]), [128, BLOCK_KV])
        # Synchronous: left in flight over the next tile's key decode (is_async), ptxas serializes every wgmma of
        # the kernel (C7513: registers of a wgmma's A operand defined while one is pending).
        acc = warpgroup_mma(gl.convert_layout(values, OPERAND_A), probabilities, acc)
        slot = gl.where(slot == STAGES - 1, 0, slot + 1)

    running_sum = gl.sum(gl.sum(lane_sum, axis=0), axis=0)
    zero_sum = gl.sum(gl.sum(lane_zero_sum, axis=0), axis=0)
    running_sum = gl.convert_layout(running_sum, gl.SliceLayout(0, ACC))
    zero_sum = gl.convert_layout(zero_sum, gl.SliceLayout(0, ACC))
    # Row 64s + 16w + 8r + g of out^T is head dim 4 (8w + g) + r + 2s, times 2**-24 (r = 0) or 2**-20 (r = 1).
    out_row = gl.arange(0, 128, layout=gl.SliceLayout(1, ACC))
    code_unit = gl.where(((out_row >> 3) & 1) == 1, 1048576.0, 16777216.0)
    inverse_sum = 1.0 / gl.where(running_sum > 0.0, running_sum, 1.0)
    out = (acc * code_unit[:, None] + zero_sum[None, :]) * inverse_sum[None, :]
    # [s, w, r, g] -> head dim order [w, g, s, r]
    out = gl.reshape(gl.permute(gl.reshape(out, [2, 4, 2, 8, BLOCK_H]), [1, 3, 0, 2, 4]), [128, BLOCK_H])
    STORES: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    out = gl.convert_layout(out, STORES)
    out_column = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, STORES))
    column_ok = out_column < Q_LEN * GROUP_SIZE
    partial_row = (seq * Q_LEN + out_column // GROUP_SIZE) * num_q_heads + kv_head * GROUP_SIZE \
        + out_column % GROUP_SIZE
    rows = partial_row.to(gl.int64) * split_capacity + split
    store_dim = gl.arange(0, 128, layout=gl.SliceLayout(1, STORES))
    gl.store(partial_out_ptr + rows[None, :] * _HEAD_DIM + store_dim[:, None], out, mask=column_ok[None, :])
    lse = gl.where(running_sum > 0.0, running_max + gl.log2(running_sum), float("-inf"))
    lse_column = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, ACC))
    lse_rows = ((seq * Q_LEN + lse_column // GROUP_SIZE) * num_q_heads + kv_head * GROUP_SIZE
                + lse_column % GROUP_SIZE).to(gl.int64) * split_capacity + split
    gl.store(partial_lse_ptr + lse_rows, lse, mask=lse_column < Q_LEN * GROUP_SIZE)
