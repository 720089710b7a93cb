"""moetrain's token file (docs/data_format.md), written as a stream.

    with TokenFileWriter("out.tok", loss_mask=True) as w:
        w.add([1, 2, 3], [0, 1, 1])

Tokens and mask go to temporary files while documents arrive (the corpus is never held in
memory); close() assembles header, offsets, tokens and mask into `path` and renames it into place
after fsync, so a reader sees no file or the whole one. An exception inside the `with` leaves no
file behind.
"""
import array
import os
import shutil
import struct
import sys

MAGIC = b"MTTOKENS"
VERSION = 1
FLAG_LOSS_MASK = 1
assert sys.byteorder == "little", "the token file is little-endian; so is every supported host"


class TokenFileWriter:
    def __init__(self, path, loss_mask):
        self.path, self.loss_mask = path, loss_mask
        self.offsets = array.array("Q", [0])
        self._tokens = open(path + ".tokens.tmp", "wb")
        self._mask = open(path + ".mask.tmp", "wb") if loss_mask else None

    def add(self, tokens, mask=None):
        """One document: token ids (< 2^32) and, in a file with a loss mask, 0/1 per token (None:
        every token counts)."""
        if not tokens:
            raise ValueError("a document needs at least one token")
        self._tokens.write(array.array("I", tokens).tobytes())
        if self._mask is not None:
            if mask is None:
                mask = [1] * len(tokens)
            if len(mask) != len(tokens):
                raise ValueError(f"{len(mask)} mask values for {len(tokens)} tokens")
            self._mask.write(bytes(mask))
        self.offsets.append(self.offsets[-1] + len(tokens))

    @property
    def num_docs(self):
        return len(self.offsets) - 1

    @property
    def num_tokens(self):
        return self.offsets[-1]

    def close(self):
        for f in (self._tokens, self._mask):
            if f is not None:
                f.close()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as out:
            flags = FLAG_LOSS_MASK if self.loss_mask else 0
            out.write(MAGIC + struct.pack("<IIQQ", VERSION, flags, self.num_docs, self.num_tokens))
            out.write(self.offsets.tobytes())
            for part in (self.path + ".tokens.tmp", self.path + ".mask.tmp"):
                if os.path.exists(part):
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
            out.flush()
            os.fsync(out.fileno())
        self._remove_parts(self.path + ".tokens.tmp", self.path + ".mask.tmp")
        os.replace(tmp, self.path)

    def abort(self):
        for f in (self._tokens, self._mask):
            if f is not None:
                f.close()
        self._remove_parts(self.path + ".tokens.tmp", self.path + ".mask.tmp", self.path + ".tmp")

    @staticmethod
    def _remove_parts(*parts):
        for part in parts:
            if os.path.exists(part):
                os.remove(part)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.abort()
        return False
