"""Expressions and statements the templates splice in, generated from the layout's facts: where each code's bits
lie in its group word (layout.group_word_bit), byte-permute selectors, the store's binary search and the splits and
joins of a lane's units. `Plan` inherits them; each returns text of one expression or a few short statements.
"""

from __future__ import annotations


class CodeExpressions:
    """The code expressions of a plan: they read only `self.layout`."""

    def code_of(self, word: str, k: int, bits: int) -> str:
        """Code k of a group word (layout.group_word_bit): contiguous bits, except split 3-bit codes."""
        bit = self.layout.group_word_bit
        if self.layout.split_high_bits(bits):
            return f"(({word} >> {bit(3, k, 0)}) & 3) | (({word} >> {bit(3, k, 2) - 2}) & 4)"
        return f"({word} >> {bit(bits, k, 0)}) & {2**bits - 1}"

    def split_shift(self, stream: str, code: str) -> str:
        """Split 3-bit codes: the shift of each code of a group (tensor `code` of 0..7) into its word of
        `stream` ("low" or "high"), from the layout's orders (Layout.split_shift_terms)."""
        first, second, third = self.layout.split_shift_terms(stream)
        return f"({code} & 1) * {first} + ({code} >> 1 & 1) * {second} + ({code} >> 2) * {third}"

    def nibble_selector(self, bits: int, word: str, first_code: int) -> str:
        """Expression that moves codes first_code..first_code+3 of a group word into the four
        nibbles of a byte-permute selector (code k at bits 4k..). Bits moved by the same shift
        share one mask, so a bit stream costs a shift and a mask per distinct distance."""
        masks: dict[int, int] = {}  # right shift -> mask of the destination bits
        for k in range(4):
            for bit in range(bits):
                target = 4 * k + bit
                shift = self.layout.group_word_bit(bits, first_code + k, bit) - target
                masks[shift] = masks.get(shift, 0) | (1 << target)
        terms = []
        for shift, mask in sorted(masks.items()):
            moved = word if shift == 0 else f"({word} >> {shift})" if shift > 0 else f"({word} << {-shift})"
            terms.append(f"({moved} & 0x{mask:X})")
        return terms[0][1:-1] if len(terms) == 1 else " | ".join(terms)

    def split_key_selector(self, low: str, high: str, first_code: int) -> str:
        """Split 3-bit keys, two group words at once: the expression that puts codes first_code..first_code+3
        of group word e into nibbles 0..3 of bits 16e.. (a byte-permute selector in each 16-bit half). `low`
        holds the words' 2-bit low streams (word e at bits 16e..), `high` their high bytes at bits 16e..16e+7.

        Low bits are masked where they lie after one right shift per distance (as nibble_selector); high bits
        are masked and moved left by multiplies, whose sum the compiler fuses into multiply-adds: the
        integer pipe then does one mask per distance, the multiplier the rest.
        """
        layout = self.layout
        low_masks: dict[int, int] = {}  # right shift -> destination mask (one 16-bit half)
        high_masks: dict[int, int] = {}  # left shift -> source mask
        for k in range(4):
            code = first_code + k
            for bit in range(2):
                shift = layout.group_word_bit(3, code, bit) - (4 * k + bit)
                low_masks[shift] = low_masks.get(shift, 0) | 1 << (4 * k + bit)
            source = layout.group_word_bit(3, code, 2) - 16
            shift = 4 * k + 2 - source
            assert shift >= 0, (code, source)
            high_masks[shift] = high_masks.get(shift, 0) | 1 << source
        pair = 0x10001  # the same mask in both 16-bit halves
        terms = []
        for shift, mask in sorted(low_masks.items()):
            assert shift >= 0, "split low bits never move left"
            moved = low if shift == 0 else f"({low} >> {shift})"
            terms.append(f"({moved} & 0x{mask * pair:08X})")
        moved_high = [f"({high} & 0x{mask * pair:08X})" + (f" * {1 << shift}" if shift else "")
                      for shift, mask in sorted(high_masks.items())]
        return " | ".join(terms) + " | (" + " + ".join(moved_high) + ")"

    # mma_halfword_slots, 3-bit keys: a key lane's copied words (first..fourth) hold its 12 code bytes from byte
    # `shift` (0 or 2); group k (3 bytes, codes 8k..8k+7) is taken by one byte permute of two neighbouring words,
    # selector base + shift * 0x1111, as the bytes [b0, b1, b1, b2] (packed_key_selector_steps reads that form).
    PACKED_GROUP_PERMUTES = (("first", "second", 0x2110), ("first", "second", 0x5443), ("second", "third", 0x4332),
                             ("third", "fourth", 0x3221))

    @property
    def packed_key_selector_steps(self) -> list[tuple[str, str]]:
        """mma_halfword_slots, 3-bit keys: statements (name, expression) that turn a group word [b0, b1, b1, b2]
        (`word`; codes 0..3 at bits 3k, codes 4..7 at bits 20 + 3k) into `both`, the byte-permute selectors of
        codes 0..3 and 4..7 (code k in nibble k, bit 3 clear) in its low and high 16-bit halves: codes 4..7
        beside codes 0..3; codes 2j, 2j + 1 to bits 8j.. of each half by a multiply-add; code 2j + 1 one bit up
        by an add (its bits doubled)."""
        return [("both", "(word & 0xFFF) | ((word >> 4) & 0x0FFF0000)"),
                ("both", "(both & 0x003F003F) + (both & 0x0FC00FC0) * 4"),
                ("both", "both + (both & 0x38383838)")]

    @staticmethod
    def lane_split_steps(prefix: str, source: str, names: list[str]) -> list[tuple[str, str]]:
        """Statements (targets, expression) that give a lane's n = len(names) units (a power of two) as n tensors,
        names[i] holding unit i: `source` is [..., lanes, 2, ..., 2] (the unit's bits, its lowest last), and gl.split
        takes the lowest bit off first (intermediate tensors are named prefix + the bits taken so far)."""
        if len(names) <= 2:
            return [(names[0], source) if len(names) == 1 else (f"{names[0]}, {names[1]}", f"gl.split({source})")]
        return ([(f"{prefix}0, {prefix}1", f"gl.split({source})")]
                + CodeExpressions.lane_split_steps(f"{prefix}0", f"{prefix}0", names[0::2])
                + CodeExpressions.lane_split_steps(f"{prefix}1", f"{prefix}1", names[1::2]))

    @staticmethod
    def numbered(prefix: str, count: int) -> list[str]:
        """Names prefix0 .. prefix{count - 1} (a lane's units in lane_split_steps)."""
        return [f"{prefix}{i}" for i in range(count)]

    @staticmethod
    def lane_join_steps(target: str, units: list[str]) -> list[tuple[str, str]]:
        """The inverse of lane_split_steps: statements (target, expression) that join a lane's units (names, unit i
        at i) into `target`, [..., lanes, 2, ..., 2], to be reshaped to [..., lanes * n] (intermediate tensors are
        named target + the bits joined so far)."""
        if len(units) <= 2:
            return [(target, units[0] if len(units) == 1 else f"gl.join({units[0]}, {units[1]})")]
        return (CodeExpressions.lane_join_steps(f"{target}0", units[0::2])
                + CodeExpressions.lane_join_steps(f"{target}1", units[1::2])
                + [(target, f"gl.join({target}0, {target}1)")])

    @staticmethod
    def neighbour_permutes(words: list[str], after: str, selector: str) -> list[str]:
        """mma_halfword_slots: word i of a field that starts `shift` bytes into the copied words `words` (and the
        word after them, `after`), as a byte permute of copied words i and i + 1 (selector 0x3210 + shift * 0x1111)."""
        return [f"_byte_perm({low}, {high}, {selector})" for low, high in zip(words, words[1:] + [after])]

    def halfword_key_groups(self, lane: list[str], after: str, selector: str) -> list[str]:
        """mma_halfword_slots: a key lane's group words (in order) from its copied words `lane` (and, 4-bit keys,
        `after`, key_next's word after them), `selector` holding shift * 0x1111: 4-bit keys each word from two
        neighbouring ones; 3-bit keys groups 4j..4j + 3 as [b0, b1, b1, b2] from words 3j..3j + 3
        (PACKED_GROUP_PERMUTES)."""
        if self.layout.key_bits == 4:
            return self.neighbour_permutes(lane, after, f"{selector} + 0x3210")
        quad = ("first", "second", "third", "fourth")
        return [f"_byte_perm({lane[3 * j + quad.index(low)]}, {lane[3 * j + quad.index(high)]}, "
                f"{selector} + 0x{base:04X})"
                for j in range(len(lane) // 4) for low, high, base in self.PACKED_GROUP_PERMUTES]

    @property
    def split_value_codes(self) -> list[tuple[str, int]]:
        """For the Gluon stage 1's split 3-bit values: per code k of a group (0..7), the expression that
        leaves code k at bits p..p+2 of each 16-bit half of `low`, `(low >> 8)` and `high` (a register
        pairing two tokens' 16-bit low words, and their high bytes), and p. Empty unless values are split.

        The two low bits are masked where they lie (bits 0..7 of `low` or of `low >> 8`); the high bit
        is shifted in beside them. No other bit survives the masks, so each half reads as the fp16
        subnormal code * 2**(p - 24), exact; p <= 7 keeps the code below the exponent bits (10..14).
        """
        layout = self.layout
        if not layout.split_high_bits(layout.value_bits):
            return []
        terms = []
        for code in range(8):
            low_bit = layout.group_word_bit(3, code, 0)
            assert layout.group_word_bit(3, code, 1) == low_bit + 1, "split low bits must be adjacent"
            source, position = ("low", low_bit) if low_bit < 8 else ("(low >> 8)", low_bit - 8)
            shift = position + 2 - (layout.group_word_bit(3, code, 2) - 16)
            assert position <= 7 and -7 <= shift <= 8, (code, position, shift)
            high = "high" if shift == 0 else f"(high << {shift})" if shift > 0 else f"(high >> {-shift})"
            low_mask = (3 << position) * 0x10001
            high_mask = (4 << position) * 0x10001
            terms.append((f"({source} & 0x{low_mask:08X}) | ({high} & 0x{high_mask:08X})", position))
        return terms

    @staticmethod
    def code_search_symmetric(bits: int) -> list[str]:
        """Statements that set `codes` as code_search does, for boundaries symmetric about 0 (boundary{j} equal to
        -boundary{2**bits - 2 - j}, the middle one 0): code_search's binary search of |rotated| over the upper
        half's 2**(bits-1) - 1 boundaries (bits - 1 comparisons), that half's code c, and for a negative value its
        mirror 2**bits - 1 - c (an exclusive or). A value exactly at a negative boundary takes the code below it
        instead of above: a tie, where either side is the nearest centroid to rounding. 4-bit keys: 4 selects an
        element instead of 11."""
        upper_half = 1 << (bits - 1)  # the index of the first boundary above the middle one (0)
        return ["negative = rotated < 0.0", "magnitude = tl.abs(rotated)",
                *CodeExpressions.code_search(bits - 1, value="magnitude", bit_name="half_bit", result="half_codes",
                                  first_boundary=upper_half),
                f"codes = (half_codes | {upper_half}) ^ tl.where(negative, {(1 << bits) - 1}, 0)"]

    @staticmethod
    def code_search(bits: int, value: str = "rotated", bit_name: str = "code_bit", result: str = "codes",
                    first_boundary: int = 0) -> list[str]:
        """Statements that set `codes` to each element's key code by a binary search over the
        2**bits - 1 sorted decision boundaries (scalars `boundary{j}`), for the store kernel.

        Bit `bits - 1 - level` (`code_bit{i}`, booleans) compares `rotated` with the middle
        boundary of the interval the bits above it chose: 2**level candidates, narrowed pairwise
        by tl.where over those bits, newest first. Intermediate thresholds are named
        (`threshold{i}_{fold}_{k}`) to keep each line short. `value`, `bit_name` and `result` rename
        rotated, code_bit and codes; the boundaries searched are boundary{first_boundary} on.
        """
        lines = []
        for level in range(bits):
            bit = bits - 1 - level
            width = 1 << (bits - level)  # boundaries + 1 per candidate interval
            candidates = [f"boundary{first_boundary + prefix * width + width // 2 - 1}" for prefix in range(1 << level)]
            for fold, decided in enumerate(range(bit + 1, bits)):  # newest decided bit first
                pairs = [f"tl.where({bit_name}{decided}, {candidates[k + 1]}, {candidates[k]})"
                         for k in range(0, len(candidates), 2)]
                if len(pairs) == 1:
                    candidates = pairs
                    break
                candidates = [f"threshold{bit}_{fold}_{k}" for k in range(len(pairs))]
                lines += [f"{name} = {pair}" for name, pair in zip(candidates, pairs)]
            lines.append(f"{bit_name}{bit} = {value} >= {candidates[0]}")
        lines.append(f"{result} = {bit_name}{bits - 1}.to(tl.int32) << {bits - 1}")
        lines += [f"{result} |= {bit_name}{bit}.to(tl.int32)" + (f" << {bit}" if bit else "")
                  for bit in range(bits - 2, -1, -1)]
        return lines

    @staticmethod
    def centroid_square_select(bits: int, bit_name: str = "code_bit", first: int = 0) -> list[str]:
        """Statements that set `centroid_square` to each element's squared centroid from the bits
        `code_search` decided (`code_bit{i}`) and scalars `centroid_square{j}`: a tree of tl.where
        over the bits, highest (the search's first) first: 2**bits - 1 selects and no memory access,
        for the store's norm correction. Intermediate values are named (`square{i}_{k}`) to keep
        each line short. For a codebook symmetric about 0 (code_search_symmetric), a code and its mirror have one
        square: (bits - 1, "half_bit", 2**(bits - 1)) picks among the upper half's by the bits of |y|'s search."""
        names = [f"centroid_square{first + j}" for j in range(2**bits)]
        lines = []
        for bit in range(bits - 1, -1, -1):
            half = len(names) // 2
            pairs = [f"tl.where({bit_name}{bit}, {names[half + k]}, {names[k]})" for k in range(half)]
            names = [f"square{bit}_{k}" for k in range(half)] if half > 1 else ["centroid_square"]
            lines += [f"{name} = {pair}" for name, pair in zip(names, pairs)]
        return lines
