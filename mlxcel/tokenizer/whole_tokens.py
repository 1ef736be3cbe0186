"""Cut whole tokens (special, added, user-defined) out of a text before the subword model sees it.

The tools we match use two orders:
- leftmost-longest (transformers, HF tokenizers' added vocabulary): left to right, the longest
  token that starts at each position;
- longest-first (llama.cpp's `tokenizer_st_partition`): tokens by UTF-8 length, longest first,
  each cutting all its leftmost non-overlapping occurrences out of the text the longer ones left.
They differ only where a shorter token starts before an overlapping longer one: tokens "ab" and
"bcd" cut "abcd" into "ab" + "cd" leftmost-longest, "a" + "bcd" longest-first.

Both scan with one regex shaped as a trie of the tokens, so at each position `re` tries one branch
per distinct next character, not every token (a flat alternation of Gemma 3's 6.4k control and
user-defined pieces is hundreds of times slower; docs/benchmarks.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable

Part = tuple[str, "int | None"]  # (text, None) for plain text, (token, id) for a whole token
IsText = Callable[[int, int, int], bool]  # (start, end, id) of an occurrence -> leave it as text
ORDERS = ("leftmost-longest", "longest-first")


def make_trie_regex(tokens: list[str]) -> str:
    """A regex that matches the longest of `tokens` starting at a position (greedy `?` tries the
    longer path first; sibling branches begin with different characters)."""
    root: dict = {}
    for token in tokens:
        node = root
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}  # end of a token

    def emit(node: dict) -> str:
        branches = [re.escape(char) + emit(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(root)


class WholeTokenSplitter:
    def __init__(self, tokens: dict[str, int], order: str = "leftmost-longest"):
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: must be one of {ORDERS}")
        self.tokens = {t: i for t, i in tokens.items() if t}
        self.order = order
        regex = make_trie_regex(list(self.tokens)) if self.tokens else None
        if order == "leftmost-longest":
            self._pattern = re.compile(regex) if regex else None
            return
        # Longest-first only needs the tokens present in the text: a lookahead finds the longest
        # token at every position, and the tokens that are its prefixes are present there too.
        self._pattern = re.compile(f"(?=({regex}))") if regex else None
        self._prefixes = {t: [t[:k] for k in range(1, len(t) + 1) if t[:k] in self.tokens] for t in self.tokens}
        # llama.cpp sorts by byte length (std::sort, ties unspecified): ties go by id here.
        self._rank = {t: (-len(t.encode()), i) for t, i in self.tokens.items()}

    def split(self, text: str, literal: IsText | None = None) -> list[Part]:
        """The text cut into plain parts and whole tokens. `literal(start, end, id)` True leaves
        that occurrence as text (a special token's text typed by a user, mlxcel/tokenizer/literal.py):
        leftmost-longest consumes it as text, as HF tokenizers' `encode_special_tokens` does;
        longest-first lets shorter tokens still cut it, as llama.cpp's parse_special=false does."""
        if self._pattern is None:
            return [(text, None)] if text else []
        if self.order == "leftmost-longest":
            return self._split_leftmost_longest(text, literal)
        return self._split_longest_first(text, literal)

    def _split_leftmost_longest(self, text: str, literal: IsText | None) -> list[Part]:
        parts: list[Part] = []
        pos = 0
        for match in self._pattern.finditer(text):
            token_id = self.tokens[match.group()]
            if literal is not None and literal(match.start(), match.end(), token_id):
                continue  # text: the plain part runs on over it
            if match.start() > pos:
                parts.append((text[pos : match.start()], None))
            parts.append((match.group(), token_id))
            pos = match.end()
        if pos < len(text):
            parts.append((text[pos:], None))
        return parts

    def _split_longest_first(self, text: str, literal: IsText | None) -> list[Part]:
        present = {p for m in self._pattern.finditer(text) for p in self._prefixes[m.group(1)]}
        spans: list[tuple[int, int, int | None]] = [(0, len(text), None)] if text else []
        for token in sorted(present, key=self._rank.__getitem__):
            token_id = self.tokens[token]
            cut: list[tuple[int, int, int | None]] = []
            for start, end, part_id in spans:
                if part_id is not None:
                    cut.append((start, end, part_id))
                    continue
                piece_start = search = start
                while (found := text.find(token, search, end)) >= 0:  # leftmost, non-overlapping
                    search = found + len(token)
                    if literal is not None and literal(found, search, token_id):
                        continue
                    if found > piece_start:
                        cut.append((piece_start, found, None))
                    cut.append((found, search, token_id))
                    piece_start = search
                if end > piece_start:
                    cut.append((piece_start, end, None))
            spans = cut
        return [(text[start:end], part_id) for start, end, part_id in spans]
