#!/usr/bin/env bash
cd /app
awk -F, '$1 == "pear" {print $2}' prices.csv > price.txt
