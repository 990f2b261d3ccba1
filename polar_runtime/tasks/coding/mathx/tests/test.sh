#!/usr/bin/env bash
# reward = the fraction of 5 checks of is_prime and gcd that pass
cd /app || exit 2
mkdir -p /logs/verifier
python3 -c "
import sys
sys.path.insert(0, '/app')
try:
    import mathx
except Exception:
    print(0.0); raise SystemExit
cases = [lambda: mathx.is_prime(7), lambda: not mathx.is_prime(9), lambda: not mathx.is_prime(1),
         lambda: mathx.gcd(12, 18) == 6, lambda: mathx.gcd(7, 5) == 1]
ok = 0
for c in cases:
    try:
        ok += bool(c())
    except Exception:
        pass
print(ok / len(cases))" > /logs/verifier/reward.txt
