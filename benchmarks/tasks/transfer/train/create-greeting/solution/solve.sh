#!/usr/bin/env bash
cd /app
printf 'good morning\n' > greeting.txt
