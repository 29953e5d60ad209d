"""Byte-level map of a DCP checkpoint's structure, for the mutation test (test_mutations.py).

Every byte of `.metadata` and of the `__<rank>_0.distcp` files is labelled with a region: a coarse
`kind` (what the mutant generator weights by) and a finer `field` (what disagreements are grouped
by). The rank files are parsed here from the zip format (APPNOTE.TXT), not with `zipfile`, because
we need the offset of every header field, and a reader that tolerates what torch's miniz tolerates
would hide exactly the bytes we want to flip. The `.metadata` pickle is mapped with
`pickletools.genops` (opcode bytes vs. argument bytes).
"""

from __future__ import annotations

import bisect
import pickle
import pickletools
import struct
from dataclasses import dataclass
from pathlib import Path

# Zip record layouts: (field name, struct format) in file order, little-endian.
LFH = [("signature", "I"), ("version_needed", "H"), ("flags", "H"), ("method", "H"), ("mtime", "H"),
       ("mdate", "H"), ("crc32", "I"), ("compressed_size", "I"), ("uncompressed_size", "I"),
       ("name_length", "H"), ("extra_length", "H")]
CDH = [("signature", "I"), ("version_made_by", "H"), ("version_needed", "H"), ("flags", "H"), ("method", "H"),
       ("mtime", "H"), ("mdate", "H"), ("crc32", "I"), ("compressed_size", "I"), ("uncompressed_size", "I"),
       ("name_length", "H"), ("extra_length", "H"), ("comment_length", "H"), ("disk_start", "H"),
       ("internal_attr", "H"), ("external_attr", "I"), ("local_header_offset", "I")]
EOCD = [("signature", "I"), ("disk", "H"), ("cd_disk", "H"), ("entries_on_disk", "H"), ("entries", "H"),
        ("cd_size", "I"), ("cd_offset", "I"), ("comment_length", "H")]
ZIP64_EOCD = [("signature", "I"), ("record_size", "Q"), ("version_made_by", "H"), ("version_needed", "H"),
              ("disk", "I"), ("cd_disk", "I"), ("entries_on_disk", "Q"), ("entries", "Q"), ("cd_size", "Q"),
              ("cd_offset", "Q")]
ZIP64_LOCATOR = [("signature", "I"), ("eocd_disk", "I"), ("eocd_offset", "Q"), ("disks", "I")]

SIG_LFH, SIG_CDH, SIG_EOCD = 0x04034B50, 0x02014B50, 0x06054B50
SIG_ZIP64_EOCD, SIG_ZIP64_LOCATOR = 0x06064B50, 0x07064B50
ZIP64_EXTRA_ID = 0x0001

METADATA = ".metadata"


@dataclass(frozen=True)
class Region:
    file: str
    start: int  # absolute offset in the file
    end: int
    kind: str  # weighting class, e.g. "zip-lfh", "rec-data.pkl", "meta-global"
    field: str  # grouping label, e.g. "zip-lfh.crc32"
    where: str  # human context: item and zip member, or pickle position


def _record(data: bytes, file: str, pos: int, layout, kind: str, where: str) -> tuple[list[Region], dict, int]:
    """Regions and values of one fixed-size zip record at absolute offset `pos`, and its end offset."""
    regions, values = [], {}
    for name, fmt in layout:
        size = struct.calcsize("<" + fmt)
        values[name] = struct.unpack_from("<" + fmt, data, pos)[0]
        regions.append(Region(file, pos, pos + size, kind, f"{kind}.{name}", where))
        pos += size
    return regions, values, pos


def _extra_regions(data: bytes, file: str, start: int, end: int, kind: str, where: str) -> list[Region]:
    """An extra-field block: 4-byte headers and zip64 payloads are structure; torch's FB padding is filler."""
    out, pos = [], start
    while pos + 4 <= end:
        tag, size = struct.unpack_from("<HH", data, pos)
        out.append(Region(file, pos, pos + 4, kind, f"{kind}.header", where))
        payload_end = min(pos + 4 + size, end)
        payload_kind = kind if tag == ZIP64_EXTRA_ID else "zip-extra-padding"
        if payload_end > pos + 4:
            out.append(Region(file, pos + 4, payload_end, payload_kind, f"{payload_kind}.{tag:#06x}", where))
        pos = payload_end
    if pos < end:  # a truncated trailing header
        out.append(Region(file, pos, end, kind, f"{kind}.trailing", where))
    return out


def _zip64_sizes(data: bytes, extra_start: int, extra_end: int, values: dict) -> dict:
    """Replace 0xFFFFFFFF sizes/offset with the zip64 extra field's values, in the order the spec gives."""
    pos = extra_start
    while pos + 4 <= extra_end:
        tag, size = struct.unpack_from("<HH", data, pos)
        if tag == ZIP64_EXTRA_ID:
            q = pos + 4
            for name in ("uncompressed_size", "compressed_size", "local_header_offset"):
                if values.get(name) == 0xFFFFFFFF and q + 8 <= pos + 4 + size:
                    values[name] = struct.unpack_from("<Q", data, q)[0]
                    q += 8
        pos += 4 + size
    return values


def _member_kind(name: str) -> str:
    """Kind of a zip member's payload: tensor bytes, or one of torch.save's small records."""
    base = name.split("/", 1)[1] if "/" in name else name
    if base.startswith("data/"):
        return "tensor-data"
    return f"rec-{base}"  # data.pkl, byteorder, version, .format_version, .storage_alignment, ...


def zip_item_regions(file: str, data: bytes, base: int, length: int, label: str) -> list[Region]:
    """Regions of one torch.save zip archive stored at data[base : base+length]."""
    end = base + length
    eocd_pos = data.rfind(struct.pack("<I", SIG_EOCD), max(base, end - 22 - 0xFFFF), end - 18)
    if eocd_pos < 0:
        raise ValueError(f"{file}: no end-of-central-directory record in item {label}")
    regions, eocd, pos = _record(data, file, eocd_pos, EOCD, "zip-eocd", label)
    if pos < end:
        regions.append(Region(file, pos, end, "zip-eocd", "zip-eocd.comment", label))
    cd_offset, entries = eocd["cd_offset"], eocd["entries"]

    locator_pos = eocd_pos - 20
    if locator_pos >= base and struct.unpack_from("<I", data, locator_pos)[0] == SIG_ZIP64_LOCATOR:
        more, locator, _ = _record(data, file, locator_pos, ZIP64_LOCATOR, "zip64-locator", label)
        regions += more
        more, z64, _ = _record(data, file, base + locator["eocd_offset"], ZIP64_EOCD, "zip64-eocd", label)
        regions += more
        cd_offset, entries = z64["cd_offset"], z64["entries"]

    pos = base + cd_offset
    for _ in range(entries):
        more, cd, fixed_end = _record(data, file, pos, CDH, "zip-cd", label)
        name_end = fixed_end + cd["name_length"]
        extra_end = name_end + cd["extra_length"]
        name = data[fixed_end:name_end].decode("utf-8", "replace")
        where = f"{name} of item {label}"
        regions += [Region(r.file, r.start, r.end, r.kind, r.field, where) for r in more]
        regions.append(Region(file, fixed_end, name_end, "zip-cd-name", "zip-cd-name", where))
        regions += _extra_regions(data, file, name_end, extra_end, "zip-cd-extra", where)
        if cd["comment_length"]:
            regions.append(Region(file, extra_end, extra_end + cd["comment_length"], "zip-cd", "zip-cd.comment", where))
        cd = _zip64_sizes(data, name_end, extra_end, cd)
        regions += _local_entry(file, data, base, cd, name, where)
        pos = extra_end + cd["comment_length"]
    return regions


def _local_entry(file: str, data: bytes, base: int, cd: dict, name: str, where: str) -> list[Region]:
    """Local file header, its name and extra field, and the member's payload."""
    regions, lfh, fixed_end = _record(data, file, base + cd["local_header_offset"], LFH, "zip-lfh", where)
    name_end = fixed_end + lfh["name_length"]
    extra_end = name_end + lfh["extra_length"]
    regions.append(Region(file, fixed_end, name_end, "zip-lfh-name", "zip-lfh-name", where))
    regions += _extra_regions(data, file, name_end, extra_end, "zip-lfh-extra", where)
    size = cd["compressed_size"]
    if size:
        kind = _member_kind(name)
        regions.append(Region(file, extra_end, extra_end + size, kind, kind, where))
    return regions


def metadata_regions(data: bytes) -> list[Region]:
    """Every byte of the .metadata pickle: opcode bytes and their arguments, by argument type."""
    regions = []
    ops = list(pickletools.genops(data))
    for i, (op, arg, pos) in enumerate(ops):
        nxt = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        where = f"pickle @{pos} {op.name} {str(arg)[:60] if arg is not None else ''}".rstrip()
        regions.append(Region(METADATA, pos, pos + 1, "meta-opcode", f"meta-opcode.{op.name}", where))
        if nxt <= pos + 1:
            continue
        if op.name in ("GLOBAL", "INST"):
            kind = "meta-global"
        elif op.name in ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"):
            kind = "meta-int"
        elif op.name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
                         "BINSTRING", "SHORT_BINSTRING"):
            # The length prefix and the text are different failure modes: truncation vs. a wrong name.
            width = {"BINUNICODE": 4, "BINBYTES": 4, "BINSTRING": 4, "BINUNICODE8": 8}.get(op.name, 1)
            regions.append(Region(METADATA, pos + 1, pos + 1 + width, "meta-strlen", f"meta-strlen.{op.name}", where))
            regions.append(Region(METADATA, pos + 1 + width, nxt, "meta-str", "meta-str", where))
            continue
        else:
            kind = "meta-arg"
        regions.append(Region(METADATA, pos + 1, nxt, kind, f"{kind}.{op.name}", where))
    return regions


def rank_file_regions(ckpt: Path, md) -> dict[str, list[Region]]:
    """Regions of every rank file, from the items .metadata's storage_data places in it.

    Bytes no item covers are labelled "unreferenced" (torch never reads them)."""
    items: dict[str, list[tuple[int, int, str]]] = {}
    for idx, info in md.storage_data.items():
        label = f"{idx.fqn}@{tuple(idx.offset) if idx.offset is not None else ''}"
        items.setdefault(info.relative_path, []).append((info.offset, info.length, label))
    out = {}
    for file in sorted(p.name for p in ckpt.glob("*.distcp")):
        data = (ckpt / file).read_bytes()
        regions, covered = [], 0
        for offset, length, label in sorted(items.get(file, [])):
            if offset > covered:
                regions.append(Region(file, covered, offset, "unreferenced", "unreferenced", "between items"))
            regions += zip_item_regions(file, data, offset, length, label)
            covered = max(covered, offset + length)
        if covered < len(data):
            regions.append(Region(file, covered, len(data), "unreferenced", "unreferenced", "after the last item"))
        out[file] = sorted(regions, key=lambda r: r.start)
    return out


def checkpoint_regions(ckpt: Path) -> dict[str, list[Region]]:
    """file name -> regions sorted by offset, for .metadata and every rank file."""
    raw = (ckpt / METADATA).read_bytes()
    md = pickle.loads(raw)
    regions = rank_file_regions(ckpt, md)
    regions[METADATA] = metadata_regions(raw)
    return regions


class RegionIndex:
    """Which region of one file holds a given byte (regions of a well-formed file do not overlap)."""

    def __init__(self, regions: list[Region]):
        self.regions = sorted(regions, key=lambda r: (r.start, r.end))
        self.starts = [r.start for r in self.regions]

    def at(self, offset: int) -> Region | None:
        i = bisect.bisect_right(self.starts, offset) - 1
        if i >= 0 and offset < self.regions[i].end:
            return self.regions[i]
        return None
