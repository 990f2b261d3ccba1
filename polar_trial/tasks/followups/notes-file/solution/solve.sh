#!/usr/bin/env bash
cd /app
printf 'first\nsecond\n' > notes.txt
