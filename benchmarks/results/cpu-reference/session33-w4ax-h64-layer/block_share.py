import re, sys
# Qwen2.5-Coder-1.5B: hidden 1536, intermediate 8960, 12 q heads, 2 kv heads (head 128)
K = {"qkv": 1536, "o": 1536, "gate_up": 1536, "down": 8960}
N = {"qkv": 1536 + 2 * 256, "o": 1536, "gate_up": 2 * 8960, "down": 1536}
for f in sys.argv[1:]:
    mac8 = mac = b8 = b = 0
    for line in open(f):
        m = re.match(r"^\d+\s+[\d.]+\s+.*?(qkv=\d+ o=\d+ gate_up=\d+ down=\d+)", line)
        if not m:
            continue
        for kv in m.group(1).split():
            name, n8 = kv.split("="); n8 = int(n8)
            mac8 += n8 * 128 * N[name]; mac += K[name] * N[name]
            b8 += n8; b += K[name] // 128
    print(f"{f}: 8-bit MACs {100*mac8/mac:.1f} %, 8-bit blocks {100*b8/b:.1f} % ({b8}/{b})")
