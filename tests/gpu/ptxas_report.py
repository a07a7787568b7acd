# ptxas_report.py — the kernels' resources from ptxas's report (nvcc --resource-usage; scripts/nvcc_resources.sh
# keeps it beside each object as <object>.resources): {(arch, kernel): {regs, smem, stack, spill}}, kernel the
# demangled name without return type and parameters, e.g. "attnres_fwd_kernel<float, 16>".
import re, subprocess

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def short_name(demangled):
    """'void k<float, 16>(float*, ...)' -> 'k<float, 16>' (the template arguments may hold parentheses)"""
    s = demangled
    if s.startswith("void "):
        s = s[5:]
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return s[:i].strip()
    return s.strip()


def parse(texts):
    """texts: report texts; returns {(arch, kernel): dict}"""
    rows, cur = [], None
    for text in texts:
        for line in text.splitlines():
            m = ENTRY.search(line)
            if m:
                cur = {"mangled": m.group(1), "arch": m.group(2), "regs": None, "smem": 0, "stack": 0, "spill": 0}
                rows.append(cur)
                continue
            if cur is None:
                continue
            m = FRAME.search(line)
            if m:
                cur["stack"], cur["spill"] = int(m.group(1)), int(m.group(2))
                continue
            m = USED.search(line)
            if m and cur["regs"] is None:
                cur["regs"] = int(m.group(1))
                cur["smem"] = int(m.group(2) or 0)
    names = demangle([r["mangled"] for r in rows]) if rows else []
    res = {}
    for r, d in zip(rows, names):
        r["kernel"] = short_name(d)
        key = (r["arch"], r["kernel"])
        old = res.get(key)
        if old is None or r["regs"] > old["regs"]:
            res[key] = r
    return res
