"""How many device-0 capability queries vLLM's compiled library makes, and how many the sm hook covers.

Read from the library FILE (it need not be loaded, and no CUDA is needed): the ELF tables are
read with ``struct`` and the x86-64 code is decoded with capstone. A *capability query* is one
place that reads the compute capability of a hard-coded device 0:

- a call of ``get_sm_version_num()`` (``_Z18get_sm_version_numv``), outside its own body, or
- a call of ``cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor (75), 0)`` with both
  the attribute and the device constant in the instructions before the call (an inlined
  ``get_sm_version_num``); the ComputeCapabilityMinor (76) call that goes with it is counted
  beside it (``minor``), not as a second query.

How each call reaches its function decides whether the hook covers it: ``plt`` (a call of a PLT
stub that jumps through an ``R_X86_64_JUMP_SLOT`` GOT slot; the hook rewrites those slots),
``got`` (a call through a ``GLOB_DAT`` GOT entry, as ``-fno-plt`` builds make; not rewritten) or
``direct`` (a call of the library's own definition; not rewritten, but covered when the
definition's own queries are). docs/sm-hook.md has the numbers for each vLLM release.
"""

from __future__ import annotations

import bisect
import os
import re
import struct
from dataclasses import dataclass, field

SM_SYMBOL = "_Z18get_sm_version_numv"
ATTR_SYMBOL = "cudaDeviceGetAttribute"
HOOKED = (SM_SYMBOL, ATTR_SYMBOL)
"""The symbols whose JUMP_SLOTs :func:`vllm_dualgpu.kernels.sm_hook.install_sm_hook` rewrites."""
ATTR_MAJOR, ATTR_MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor / Minor

_RSI = ("rsi", "esi", "si", "sil")
_RDX = ("rdx", "edx", "dx", "dl", "dh")


class CoverageError(RuntimeError):
    """The file cannot be analysed; the message says why."""


@dataclass(frozen=True)
class CallSite:
    """One call of a watched symbol found in the code."""

    address: int
    function: str
    symbol: str
    route: str
    """``plt``, ``got`` or ``direct`` (see the module docstring)."""
    attribute: int | None = None
    """cudaDeviceGetAttribute only: the constant attribute, None when computed."""
    device: int | None = None
    """cudaDeviceGetAttribute only: the constant device, None when computed."""


@dataclass(frozen=True)
class Coverage:
    """The capability queries of one library and which of them the hooked slots cover."""

    path: str
    slots: dict[str, tuple[int, ...]]
    """JUMP_SLOT GOT offsets (file addresses) per watched symbol."""
    hooked: tuple[str, ...]
    """The watched symbols whose slots are (or would be) rewritten and exist in this file."""
    sm_calls: tuple[CallSite, ...]
    """Calls of get_sm_version_num outside its own body."""
    inlined: tuple[CallSite, ...]
    """cudaDeviceGetAttribute(75, device 0) calls outside get_sm_version_num's body."""
    minor: tuple[CallSite, ...]
    """cudaDeviceGetAttribute(76, device 0) calls outside get_sm_version_num's body."""
    body: tuple[CallSite, ...]
    """cudaDeviceGetAttribute calls inside get_sm_version_num's own definition."""
    other_capability: int
    """Capability-attribute (75/76) calls whose device is not the constant 0 (computed at run
    time; the shim changes them only when they ask for device 0)."""
    attr_calls: int
    """Every call of cudaDeviceGetAttribute found (any attribute, any device)."""
    covered_sites: frozenset = field(default_factory=frozenset)

    @property
    def queries(self) -> tuple[CallSite, ...]:
        return self.sm_calls + self.inlined

    @property
    def total(self) -> int:
        return len(self.queries)

    @property
    def covered(self) -> int:
        return sum(1 for q in self.queries if q.address in self.covered_sites)

    @property
    def ok(self) -> bool:
        return self.covered > 0

    def functions(self, sites) -> int:
        return len({s.function for s in sites})

    def line(self) -> str:
        """One line: "N of M capability queries covered (...)", or why none is."""
        name = os.path.basename(self.path)
        sm_cov = sum(1 for q in self.sm_calls if q.address in self.covered_sites)
        in_cov = sum(1 for q in self.inlined if q.address in self.covered_sites)
        parts = [
            f"{len(self.sm_calls)} calls of get_sm_version_num ({sm_cov} covered)",
            f"{len(self.inlined)} inlined device-0 queries in {self.functions(self.inlined)} "
            f"functions ({in_cov} covered)",
        ]
        hooked = ", ".join(f"{s} ({len(self.slots.get(s, ()))} JUMP_SLOT)" for s in self.hooked) or "nothing"
        text = (
            f"{name}: {self.covered} of {self.total} capability queries covered "
            f"({'; '.join(parts)}; hooked: {hooked})"
        )
        if self.total == 0:
            return f"{name}: NOT covered: no device-0 capability query found (hooked: {hooked})"
        if self.covered == 0:
            return f"{name}: NOT covered: 0 of {self.total} capability queries ({'; '.join(parts)}; hooked: {hooked})"
        return text


def _capstone():
    try:
        import capstone
    except ImportError as exc:
        raise CoverageError(
            f"the coverage analysis needs the capstone disassembler ({exc}); pip install capstone"
        ) from None
    return capstone


# ---- the ELF file, read with struct (ELF64 little-endian: all vLLM builds this reads) ----------


@dataclass(frozen=True)
class _Section:
    name: str
    kind: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int


_SHT_PROGBITS, _SHT_SYMTAB, _SHT_RELA, _SHT_DYNSYM = 1, 2, 4, 11
_SHF_EXECINSTR = 0x4
_R_X86_64_GLOB_DAT, _R_X86_64_JUMP_SLOT = 6, 7
_STT_FUNC = 2


class _Elf:
    """The parts of an ELF64 shared object the analysis reads: sections, symbols, relocations."""

    def __init__(self, path: str, data: bytes):
        if data[:4] != b"\x7fELF":
            raise CoverageError(f"{path} is not an ELF file")
        if data[4] != 2 or data[5] != 1:
            raise CoverageError(f"{path} is not a 64-bit little-endian ELF file")
        self.data = data
        machine = struct.unpack_from("<H", data, 18)[0]
        if machine != 62:  # EM_X86_64
            raise CoverageError(f"{path}: machine {machine} is not analysed (x86-64 only)")
        shoff, = struct.unpack_from("<Q", data, 40)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 58)
        raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names = raw[shstrndx][4]
        self.sections = [
            _Section(self._string(names, r[0]), r[1], r[2], r[3], r[4], r[5], r[6]) for r in raw
        ]

    def _string(self, table_offset: int, index: int) -> str:
        start = table_offset + index
        return self.data[start : self.data.index(b"\0", start)].decode("utf-8", "replace")

    def section(self, name: str) -> _Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def bytes_of(self, s: _Section) -> bytes:
        return self.data[s.offset : s.offset + s.size]

    def symbols(self, table: _Section) -> list[tuple[str, int, int, int, int]]:
        """(name, type, shndx, value, size) of each entry of a symbol table."""
        strings = self.sections[table.link].offset
        out = []
        for name, info, _other, shndx, value, size in struct.iter_unpack("<IBBHQQ", self.bytes_of(table)):
            out.append((self._string(strings, name), info & 0xF, shndx, value, size))
        return out

    def relocations(self, wanted: set[str]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """JUMP_SLOT and GLOB_DAT GOT offsets of each wanted symbol, from every RELA section."""
        jump: dict[str, list[int]] = {s: [] for s in wanted}
        glob: dict[str, list[int]] = {s: [] for s in wanted}
        for section in self.sections:
            if section.kind != _SHT_RELA:
                continue
            table = self.sections[section.link]
            if table.kind not in (_SHT_DYNSYM, _SHT_SYMTAB):
                continue
            names = [s[0] for s in self.symbols(table)]
            for offset, info, _addend in struct.iter_unpack("<QQq", self.bytes_of(section)):
                index, kind = info >> 32, info & 0xFFFFFFFF
                if index == 0 or names[index] not in wanted:
                    continue
                if kind == _R_X86_64_JUMP_SLOT:
                    jump[names[index]].append(offset)
                elif kind == _R_X86_64_GLOB_DAT:
                    glob[names[index]].append(offset)
        return jump, glob

    def functions(self) -> list[tuple[int, int, str]]:
        """Defined function symbols (start, end, name) sorted by start: .symtab, else .dynsym."""
        for name in (".symtab", ".dynsym"):
            table = self.section(name)
            if table is None:
                continue
            funcs = sorted(
                {(v, v + size, n) for n, kind, shndx, v, size in self.symbols(table)
                 if kind == _STT_FUNC and shndx != 0 and size > 0}
            )
            if funcs:
                return funcs
        return []

    def code_sections(self) -> list[_Section]:
        return [s for s in self.sections if s.kind == _SHT_PROGBITS and s.flags & _SHF_EXECINSTR]


def analyse(path: str, hooked: tuple[str, ...] = HOOKED) -> Coverage:
    """The capability queries of the library file ``path`` and the ones covered when the JUMP_SLOTs
    of ``hooked`` are rewritten. Raises :class:`CoverageError` when it cannot read the file."""
    capstone = _capstone()
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise CoverageError(f"cannot read {path}: {exc}") from None
    try:
        elf = _Elf(path, data)
    except (struct.error, IndexError, ValueError) as exc:
        raise CoverageError(f"{path} is not a readable ELF file: {exc}") from None
    return _analyse(path, elf, hooked, capstone)


def _rip_target(capstone, insn) -> int | None:
    """The address a ``jmp/call [rip + disp]`` reads its target from, else None."""
    if len(insn.operands) != 1:
        return None
    op = insn.operands[0]
    if op.type != capstone.x86.X86_OP_MEM or op.mem.base != capstone.x86.X86_REG_RIP or op.mem.index != 0:
        return None
    return insn.address + insn.size + op.mem.disp


def _analyse(path: str, elf: _Elf, hooked: tuple[str, ...], capstone) -> Coverage:
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    watched = {SM_SYMBOL, ATTR_SYMBOL}
    jump, glob = elf.relocations(watched)
    via_slot = {a: (s, "plt") for s, addrs in jump.items() for a in addrs}
    via_slot.update({a: (s, "got") for s, addrs in glob.items() for a in addrs})

    # PLT stubs (.plt, .plt.sec, .plt.got): an indirect jmp through a GOT slot, maybe after endbr64.
    targets: dict[int, tuple[str, str]] = {}
    code = []
    for section in elf.code_sections():
        if not section.name.startswith(".plt"):
            code.append(section)
            continue
        prev = None
        for insn in cs.disasm(elf.bytes_of(section), section.addr):
            got = _rip_target(capstone, insn) if insn.mnemonic.endswith("jmp") else None
            if got in via_slot:
                targets[insn.address] = via_slot[got]
                if prev is not None and prev.mnemonic == "endbr64":
                    targets[prev.address] = via_slot[got]
            prev = insn
    funcs = elf.functions()
    definitions = {
        s: next(((a, b) for a, b, n in funcs if n == s), None) for s in watched
    }
    for s, span in definitions.items():
        if span is not None:
            targets[span[0]] = (s, "direct")

    # Candidates: rel32 call/jmp of a target; call/jmp [rip+disp] through a watched GOT slot.
    candidates: list[tuple[int, str, str]] = []
    for section in code:
        data, base = elf.bytes_of(section), section.addr
        for m in re.finditer(rb"[\xe8\xe9]", data):
            p = m.start()
            if p + 5 <= len(data):
                t = base + p + 5 + struct.unpack_from("<i", data, p + 1)[0]
                if t in targets:
                    candidates.append((base + p, *targets[t]))
        for m in re.finditer(rb"\xff[\x15\x25]", data):
            p = m.start()
            if p + 6 <= len(data):
                got = base + p + 6 + struct.unpack_from("<i", data, p + 2)[0]
                if got in via_slot:
                    candidates.append((base + p, *via_slot[got]))

    starts = [f[0] for f in funcs]
    by_function: dict[int, list[tuple[int, str, str]]] = {}
    for c in candidates:
        i = bisect.bisect_right(starts, c[0]) - 1
        if i >= 0 and funcs[i][0] <= c[0] < funcs[i][1]:
            by_function.setdefault(i, []).append(c)
    sections = elf.code_sections()
    sites: list[CallSite] = []
    for i, cands in sorted(by_function.items()):
        start, end, name = funcs[i]
        section = next(s for s in sections if s.addr <= start < s.addr + s.size)
        sites.extend(_Function(capstone, cs, elf, section, start, end, name).verify(cands))

    sm_def = definitions[SM_SYMBOL]

    def in_body(site: CallSite) -> bool:
        return sm_def is not None and sm_def[0] <= site.address < sm_def[1]

    sm_calls = tuple(s for s in sites if s.symbol == SM_SYMBOL and not in_body(s))
    attr = [s for s in sites if s.symbol == ATTR_SYMBOL]
    capability = [s for s in attr if s.attribute in (ATTR_MAJOR, ATTR_MINOR)]
    inlined = tuple(s for s in capability if s.attribute == ATTR_MAJOR and s.device == 0 and not in_body(s))
    minor = tuple(s for s in capability if s.attribute == ATTR_MINOR and s.device == 0 and not in_body(s))
    body = tuple(s for s in attr if in_body(s))
    other = sum(1 for s in capability if s.device != 0)

    present = tuple(s for s in hooked if jump.get(s))
    covered = {s.address for s in sites if s.route == "plt" and s.symbol in present}
    # A call of get_sm_version_num that reaches vLLM's own body is covered when the body's
    # queries are (they call cudaDeviceGetAttribute through its rewritten slot).
    if body and all(s.address in covered for s in body):
        covered |= {s.address for s in sm_calls}
    return Coverage(
        path=path,
        slots={s: tuple(a) for s, a in sorted(jump.items()) if a},
        hooked=present,
        sm_calls=sm_calls,
        inlined=inlined,
        minor=minor,
        body=body,
        other_capability=other,
        attr_calls=len(attr),
        covered_sites=frozenset(covered),
    )


class _Function:
    """One function's instructions (decoded from its start) and its jump targets."""

    def __init__(self, capstone, cs, elf: _Elf, section: _Section, start: int, end: int, name: str):
        self.capstone, self.cs, self.name = capstone, cs, name
        offset = section.offset + start - section.addr
        self.code = elf.data[offset : offset + (end - start)]
        self.start = start
        self.insns = list(cs.disasm_lite(self.code, start))  # (address, size, mnemonic, op_str)
        self.index = {insn[0]: k for k, insn in enumerate(self.insns)}
        self.sources: dict[int, list[int]] = {}  # jump target -> indices of the jumps to it
        for k, (_a, _s, mnemonic, op_str) in enumerate(self.insns):
            if mnemonic.startswith("j") and op_str.startswith("0x"):
                self.sources.setdefault(int(op_str, 16), []).append(k)

    def detail(self, k: int):
        address, size = self.insns[k][0], self.insns[k][1]
        off = address - self.start
        return next(self.cs.disasm(self.code[off : off + size], address, 1))

    def verify(self, cands) -> list[CallSite]:
        out = []
        for address, symbol, route in cands:
            k = self.index.get(address)
            if k is None:
                continue  # the bytes lie inside another instruction: not a call
            mnemonic = self.insns[k][2]
            if not (mnemonic.endswith("call") or mnemonic.endswith("jmp")):
                continue
            attribute = device = None
            if symbol == ATTR_SYMBOL:
                attribute = self.constant_before(k, _RSI)
                device = self.constant_before(k, _RDX)
            out.append(CallSite(address, self.name, symbol, route, attribute, device))
        return out

    def constant_before(self, k: int, regs: tuple[str, ...]) -> int | None:
        """The constant in ``regs`` when instruction ``k`` starts, the same on every path that
        reaches it inside this function; None when it is not one constant (a value computed at
        run time, the function's own argument, a call in between, or a path not followed)."""
        value = self._before(k, regs, {})
        return value if isinstance(value, int) else None

    def _before(self, k: int, regs: tuple[str, ...], memo: dict):
        if k in memo:
            # _PENDING: a loop back to an instruction being followed adds no new value
            return _NO_PATH if memo[k] is _PENDING else memo[k]
        if len(memo) > 20000:
            return None
        memo[k] = _PENDING
        address = self.insns[k][0]
        preds = list(self.sources.get(address, ()))
        if k > 0 and self.insns[k - 1][2] not in _NO_FALL_THROUGH:
            preds.append(k - 1)
        if not preds:
            # alignment padding after a jmp/ret is run by no path; anything else is the
            # function's entry or is reached only by an indirect jump
            value = _NO_PATH if k > 0 and self.insns[k][2].startswith("nop") else None
        else:
            values = {self._after(p, regs, memo) for p in preds}
            values.discard(_NO_PATH)
            value = values.pop() if len(values) == 1 else (None if values else _NO_PATH)
        memo[k] = value
        return value

    def _after(self, k: int, regs, memo):
        written = self._written(k, regs)
        return self._before(k, regs, memo) if written is _UNTOUCHED else written

    def _written(self, k: int, regs):
        mnemonic = self.insns[k][2]
        if mnemonic.endswith("call"):
            return None  # esi and edx do not survive a call
        insn = self.detail(k)
        _, written = insn.regs_access()
        if not {insn.reg_name(r) for r in written} & set(regs):
            return _UNTOUCHED
        x86 = self.capstone.x86
        ops = insn.operands
        if insn.mnemonic == "mov" and len(ops) == 2 and ops[1].type == x86.X86_OP_IMM:
            return ops[1].imm
        if insn.mnemonic == "xor" and len(ops) == 2 and ops[0].type == ops[1].type == x86.X86_OP_REG:
            if ops[0].reg == ops[1].reg:
                return 0
        return None


_NO_FALL_THROUGH = ("jmp", "bnd jmp", "ret", "bnd ret", "ud2", "hlt")
_UNTOUCHED = object()
_NO_PATH = object()
_PENDING = object()
