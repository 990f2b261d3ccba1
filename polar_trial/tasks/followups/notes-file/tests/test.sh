#!/usr/bin/env bash
# reward 1 when notes.txt holds the two lines first, second
cd /app || exit 2
mkdir -p /logs/verifier
if [ "$(cat notes.txt 2>/dev/null)" = "$(printf 'first\nsecond')" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
