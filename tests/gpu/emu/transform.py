# transform.py — a .cu file as host C++ for emu.h: kernel launches, dynamic shared memory, mma.h
import re, sys
src = open(sys.argv[1]).read()
src = src.replace('#include <mma.h>', '')
src = re.sub(r'extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];', r'\1 *\2 = (\1 *)emu::dyn_smem;', src)
# kernel<...><<<a, b, c, d>>>(  ->  emu::launch(a, b, c, d, kernel<...>, its name)(
pat = re.compile(r'([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(', re.S)
src, n = pat.subn(lambda m: 'emu::launch(%s, %s, emu::kname<%s>())(' % (m.group(2), m.group(1), m.group(1)), src)
sys.stderr.write('%s: %d launches\n' % (sys.argv[1], n))
open(sys.argv[2], 'w').write(src)
