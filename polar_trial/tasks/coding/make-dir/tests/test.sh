#!/usr/bin/env bash
# reward 1 when /app/build is a directory
cd /app || exit 2
mkdir -p /logs/verifier
if [ -d build ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
