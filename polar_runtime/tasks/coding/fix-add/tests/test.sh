#!/usr/bin/env bash
# reward 1 when calc.add adds (two cases)
cd /app || exit 2
mkdir -p /logs/verifier
if python3 -c 'import calc, sys; sys.exit(0 if calc.add(2, 3) == 5 and calc.add(-1, 1) == 0 else 1)'; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
