# cython: language_level=3, boundscheck=False, wraparound=False
"""The merges a SentencePiece vocabulary without them implies (trillm/model/gguf_tokenizer.py),
compiled: the loop tries every cut of every token, 1.2 million for Gemma 3's 262k tokens.

Why not Python's str and dict: each cut would slice out its left part, hash it and look it up in
the vocabulary, then do the same with its right part, and that was about a second of every
start-up. Here every token's prefixes are hashed in one pass over its characters (a polynomial
hash, so the hash of any suffix follows from two prefixes' by one multiplication) and looked up in
a table of the vocabulary's hashes; only a hit is compared character by character, and no string
is made: the pairs found are the vocabulary's own strings. The table keeps 8 bytes a slot, a
hash's tag and the string's index, so that Gemma 3's fits in the cache: its probes are most of
the time, and most find nothing."""
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc

cdef extern from "Python.h":
    int PyUnicode_KIND(object s)
    void *PyUnicode_DATA(object s)
    Py_UCS4 PyUnicode_READ(int kind, void *data, Py_ssize_t index) nogil

# an odd multiplier: a character's weight in the hash is a power of it, modulo 2^64
cdef uint64_t BASE = 0x9E3779B97F4A7C15ULL


cdef struct Text:  # one string's characters, as CPython keeps them
    int kind
    void *data
    Py_ssize_t length


cdef struct Merge:  # a cut that parts a token into two tokens, with what ranks it
    double score
    int32_t cut, length, order
    int32_t left, right  # indices into the vocabulary's strings


cdef struct Slot:  # a vocabulary string in the table: what a probe reads
    uint32_t tag  # the hash's top half: a probe compares characters only where it matches
    int32_t index  # -1: empty


cdef class _Table:
    """The vocabulary's strings by hash (open addressing, at most half full); owns its slots and
    the strings' texts, and holds the strings, whose characters the texts point into."""
    cdef list strings
    cdef Slot *slots
    cdef Text *texts
    cdef uint64_t mask
    cdef int shift

    def __cinit__(self, list strings):
        self.strings = strings
        cdef Py_ssize_t n = len(strings), i, size = 2
        self.shift = 63
        while size < 2 * n:
            size *= 2
            self.shift -= 1
        self.mask = size - 1
        self.slots = <Slot *>malloc(size * sizeof(Slot))
        self.texts = <Text *>malloc(max(n, 1) * sizeof(Text))
        if self.slots == NULL or self.texts == NULL:
            raise MemoryError()
        for i in range(size):
            self.slots[i].index = -1
        cdef uint64_t at, h
        for i in range(n):
            self.texts[i] = _text(strings[i])
            h = _hash(&self.texts[i], 0, self.texts[i].length)
            at = self.slot(h)
            while self.slots[at].index != -1:
                at = (at + 1) & self.mask
            self.slots[at] = Slot(<uint32_t>(h >> 32), <int32_t>i)

    def __dealloc__(self):
        free(self.slots)
        free(self.texts)

    cdef inline uint64_t slot(self, uint64_t h):
        # the product's top bits: a polynomial hash's low bits depend on its characters' low bits only
        return (h * BASE) >> self.shift

    cdef int32_t find(self, uint64_t h, Text *text, Py_ssize_t start, Py_ssize_t end):
        """The index of the string equal to text[start:end] (its hash h), or -1."""
        cdef uint64_t at = self.slot(h)
        cdef uint32_t tag = <uint32_t>(h >> 32)
        cdef Slot *slot
        while True:
            slot = &self.slots[at]
            if slot.index == -1:
                return -1
            if slot.tag == tag and _equal(&self.texts[slot.index], text, start, end):
                return slot.index
            at = (at + 1) & self.mask


cdef Text _text(str s):
    cdef Text text
    text.kind = PyUnicode_KIND(s)
    text.data = PyUnicode_DATA(s)
    text.length = len(s)
    return text


cdef inline uint64_t _extend(uint64_t h, Text *text, Py_ssize_t i):
    """The hash of a string's characters up to i - 1 (h) extended by character i."""
    return h * BASE + <uint64_t>PyUnicode_READ(text.kind, text.data, i) + 1


cdef inline uint64_t _hash(Text *text, Py_ssize_t start, Py_ssize_t end):
    cdef uint64_t h = 0
    cdef Py_ssize_t i
    for i in range(start, end):
        h = _extend(h, text, i)
    return h


cdef bint _equal(Text *whole, Text *text, Py_ssize_t start, Py_ssize_t end):
    if whole.length != end - start:
        return False
    cdef Py_ssize_t i
    for i in range(end - start):
        if PyUnicode_READ(whole.kind, whole.data, i) != PyUnicode_READ(text.kind, text.data, start + i):
            return False
    return True


cdef int _before(const void *a, const void *b) noexcept nogil:
    """Best first: the higher score, then the longer left part, then the longer right part, then
    the token's place."""
    cdef const Merge *x = <const Merge *>a
    cdef const Merge *y = <const Merge *>b
    if x.score != y.score:
        return -1 if x.score > y.score else 1
    if x.cut != y.cut:
        return -1 if x.cut > y.cut else 1
    if x.length - x.cut != y.length - y.cut:
        return -1 if x.length - x.cut > y.length - y.cut else 1
    return -1 if x.order < y.order else (1 if x.order > y.order else 0)


def derived_merges(dict vocab, dict scores=None) -> list:
    """Every split of a token of `scores` into two tokens of `vocab`, best first: by the token's
    score, then the longer left part, then the longer right part, ties in the order of `scores`
    (transformers' `generate_merges(vocab, scores)`, whose sort of each token's own candidates
    never decides anything: a token's splits differ in their left part's length). Scores are
    numbers a float holds exactly (a file's float32 scores, or places); ValueError otherwise.
    Without scores, every token of `vocab` ranks by its place: its score is minus its index."""
    cdef list strings = list(vocab)
    cdef _Table table = _Table(strings)
    cdef Py_ssize_t capacity = 1024, count = 0, longest = 1, order = 0, cut, length
    ranked = ((token, -index) for token, index in vocab.items()) if scores is None else scores.items()
    for token in (vocab if scores is None else scores):
        longest = max(longest, len(<str>token))
    cdef uint64_t *prefix = <uint64_t *>malloc((longest + 1) * sizeof(uint64_t))
    cdef uint64_t *power = <uint64_t *>malloc((longest + 1) * sizeof(uint64_t))
    cdef Merge *found = <Merge *>malloc(capacity * sizeof(Merge))
    cdef Merge *grown
    cdef Text text
    cdef int32_t left, right
    cdef double value
    try:
        if prefix == NULL or power == NULL or found == NULL:
            raise MemoryError()
        power[0] = 1
        for cut in range(1, longest + 1):
            power[cut] = power[cut - 1] * BASE
        for token, score in ranked:
            value = score
            if value != score:
                raise ValueError(f"a token's score is not a number a float holds exactly: {score!r}")
            text = _text(token)
            length = text.length
            prefix[0] = 0
            for cut in range(length):
                prefix[cut + 1] = _extend(prefix[cut], &text, cut)
            for cut in range(1, length):
                left = table.find(prefix[cut], &text, 0, cut)
                if left == -1:  # the right part is looked up only then: most left parts are not tokens
                    continue
                right = table.find(prefix[length] - prefix[cut] * power[length - cut], &text, cut, length)
                if right == -1:
                    continue
                if count == capacity:
                    capacity *= 2
                    grown = <Merge *>realloc(found, capacity * sizeof(Merge))
                    if grown == NULL:
                        raise MemoryError()
                    found = grown
                found[count] = Merge(value, <int32_t>cut, <int32_t>length, <int32_t>order, left, right)
                count += 1
            order += 1
        qsort(found, count, sizeof(Merge), _before)
        return [(strings[found[i].left], strings[found[i].right]) for i in range(count)]
    finally:
        free(prefix)
        free(power)
        free(found)

