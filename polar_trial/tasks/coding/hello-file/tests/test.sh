#!/usr/bin/env bash
# reward 1 when /app/hello.txt holds exactly "hello world" (newlines ignored)
cd /app || exit 2
mkdir -p /logs/verifier
if [ "$(tr -d '\n' < hello.txt 2>/dev/null)" = 'hello world' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
