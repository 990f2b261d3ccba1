#!/usr/bin/env bash
cd /app
printf 'done\n' >> log.txt
