#!/usr/bin/env bash
# reward 1 when src/main.py exists
cd /app || exit 2
mkdir -p /logs/verifier
if [ -d src ] && [ -f src/main.py ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
