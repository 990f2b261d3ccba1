#!/usr/bin/env bash
cd /app
grep -l zebra a.txt b.txt c.txt > answer.txt
