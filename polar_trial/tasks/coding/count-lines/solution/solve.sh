#!/usr/bin/env bash
cd /app
wc -l < data.txt > count.txt
