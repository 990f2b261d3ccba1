#!/usr/bin/env bash
# reward 1 when count.txt holds 7 (data.txt has 7 lines)
cd /app || exit 2
mkdir -p /logs/verifier
if [ "$(tr -d ' \n' < count.txt 2>/dev/null)" = 7 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
