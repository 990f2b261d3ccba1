#!/usr/bin/env bash
# The reference fix: revert the introduced bug.
cd /app
python3 - <<'EOF'
from pathlib import Path
p = Path('inflection/__init__.py')
s = p.read_text()
good, bad = '    word = re.sub(r"([A-Z]+)([A-Z][a-z])", r\'\\1_\\2\', word)\n', ''
anchor = '    word = re.sub(r"([a-z\\d])([A-Z])", r\'\\1_\\2\', word)\n'
s = s.replace(bad, good, 1) if bad else s.replace(anchor, good + anchor, 1)
p.write_text(s)
EOF
