"""Plain-Python twins of tract's kernels: the specification each fast path is
tested against (STYLE habit 5)."""


def _bit(words, index):
    return (int(words[index // 64]) >> (index % 64)) & 1


def count_free(words, nbits):
    return sum(1 for index in range(nbits) if not _bit(words, index))


def first_free_run(words, nbits, count, start=0):
    for begin, end in ((start, nbits), (0, min(start + count - 1, nbits))):
        run = 0
        for index in range(begin, end):
            run = 0 if _bit(words, index) else run + 1
            if run == count:
                return index - count + 1
    return -1
