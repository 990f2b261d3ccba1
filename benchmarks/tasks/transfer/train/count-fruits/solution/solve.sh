#!/usr/bin/env bash
cd /app
wc -l < fruits.txt | tr -d ' ' > count.txt
