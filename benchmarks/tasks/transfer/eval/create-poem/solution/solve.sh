#!/usr/bin/env bash
cd /app
printf 'roses are red\n' > poem.txt
